"""ironserve roles: one package per role, each with a single @deploy entry and documented defaults."""
