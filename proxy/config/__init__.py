"""Settings: the option vocabulary, the Settings dataclasses, and loading TOML."""
