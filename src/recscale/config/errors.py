class ConfigError(ValueError):
    """A configuration problem. ``key`` is the dotted key at fault (``model.embedding_dim``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"config key '{key}': {message}")
