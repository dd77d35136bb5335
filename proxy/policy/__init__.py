"""The release policy: which versions clients may have (docs/architecture.md, "Release policy")."""
