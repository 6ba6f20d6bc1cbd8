"""The native module: the harness's case checker, in-process."""

from typing import Tuple

__version__: str

class CaseError(ValueError):
    """A case that cannot be checked: a missing or malformed tensor or option, named in the message."""

def check_case(case: bytes, mpfr: bool = False) -> Tuple[str, str]:
    """Checks the case file whose bytes are `case`; returns the report as JSON and as text."""
