"""Package data, not code: the roles' jinja2 templates, templates/<role>/<name>, shipped as ironserve.templates
(read through ironserve.layout.role_template)."""
