"""argparse types that refuse a flag's value by the flag's name (argparse's own error) before anything runs."""

from __future__ import annotations

import argparse
import math
import re
import struct
from collections.abc import Callable

INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)
# ASCII digits only: int() would also take "1_0" and other scripts' digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer flag in [low, high] (a protobuf field's range, or what the flag means)."""

    def parse(text: str) -> int:
        if not _INTEGER.fullmatch(text.strip()) or not low <= (value := int(text)) <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer in [{low}, {high}]")
        return value

    return parse


def positive_finite(text: str) -> float:
    """A float flag that must be finite and above 0 (a weight)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0")
    return value


def top_p(text: str) -> float:
    """A nucleus-sampling flag in (0, 1]. The request's field is a float32: a value that rounds to 0 there, like 0
    itself, the router refuses, so it is refused here, by the flag's name."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1 or struct.unpack("f", struct.pack("f", value))[0] == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1], and not so small that a 32-bit float holds 0")
    return value


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names it (`baton sim --help` showed none,
    helper-161); a list's items are joined by commas, as the flag takes them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default in (None, "") or action.default in ((), []):
            return f"{text} (default: none)"
        if isinstance(action.default, tuple | list):
            items = ",".join(f"{item:g}" if isinstance(item, float) else str(item) for item in action.default)
            return f"{text} (default: {items.replace('%', '%%')})"
        return f"{text} (default: %(default)s)"
