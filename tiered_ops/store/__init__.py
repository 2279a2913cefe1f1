"""The store: SQLite or PostgreSQL behind one interface, and what a stored row says (``rows``). The only code that
speaks SQL."""
