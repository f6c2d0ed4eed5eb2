"""Exercise checkers: `check.<exercise>(answer)` prints ✓ or a friendly hint and returns a bool.

Each checker computes the right answer with kvlab itself, so it never disagrees with the course.
"""

from __future__ import annotations


def _report(ok: bool, success: str, hint: str) -> bool:
    print(f"✓ {success}" if ok else f"✗ Not yet. Hint: {hint}")
    return ok


def _close(answer, expected, rel: float = 1e-6) -> bool:
    try:
        return abs(float(answer) - float(expected)) <= rel * max(1.0, abs(float(expected)))
    except (TypeError, ValueError):
        return False
