"""The one exception a bad configuration raises, carrying every problem found, not just the first.

Kept free of heavy imports (no pydantic, no Hydra) so the CLI can catch it around any command cheaply.
"""

from __future__ import annotations


class ConfigError(Exception):
    """An invalid configuration. `problems` lists each issue; each names the dotted key and the fix.

    Reporting everything at once saves the edit-run-fail loop of fixing one key per launch.
    """

    def __init__(self, problems: list[str] | str):
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        count = len(self.problems)
        head = f"invalid configuration ({count} problem{'s' if count != 1 else ''}):"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])

    def __reduce__(self):  # picklable across Ray / multiprocessing boundaries
        return (type(self), (self.problems,))
