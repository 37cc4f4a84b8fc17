"""The backend matrix and the user and repo config layers: schema, strict validation, load."""
