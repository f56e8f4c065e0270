"""Database layer: models, engine/session setup, repositories (all SQL lives in repositories)."""
