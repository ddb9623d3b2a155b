"""What the package checks of tests/python share (each runs as a script, so this folder is on its
path)."""

from __future__ import annotations


def expect(exc: type, fn, *args, match: str = "", **kwargs) -> str:
    """Calls fn(*args, **kwargs), which must raise `exc` with `match` in its text; returns the
    text. Another exception, or none, fails with what happened instead."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        text = str(e)
        assert match in text, f"{exc.__name__} without {match!r}: {text}"
        return text
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{fn.__name__}{args}: {type(e).__name__} ({e}), not {exc.__name__}") from e
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")
