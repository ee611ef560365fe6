"""Configuration: the schema, its checks, and which changes a resume may make."""
