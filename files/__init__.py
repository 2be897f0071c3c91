"""Package data, not code: the files roles use as they are, files/<role>/<name>, shipped as ironserve.files
(read through ironserve.layout.role_file)."""
