class ConfigError(ValueError):
    """A configuration problem. ``key`` is the dotted key at fault (``model.embedding_dim``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"config key '{key}': {message}")

    def __reduce__(self):  # pickled by its fields: from a rank to the parent (spawn.py)
        return (type(self), (self.key, self.message))


class EnvironmentSettingError(ValueError):
    """An environment variable recscale or a library it loads reads holds a value that
    cannot be used: one line naming the variable, its value and what it takes."""

    def __init__(self, name: str, value: str, takes: str) -> None:
        self.name = name
        super().__init__(f"environment variable {name}={value!r}: {takes}")


def counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` things in a message: ``counted(1, "rank")`` is "1 rank", ``counted(3,
    "entry", "entries")`` "3 entries" ("1 ranks" reads as a slip in a message about what
    went wrong)."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def value_text(value: object) -> str:
    """A config value as a message quotes it, in TOML's spelling where Python's differs
    (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)
