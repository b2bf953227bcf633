"""The one error a model file (or directory) can raise: it names the file and the problem."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ModelFileError"]


class ModelFileError(ValueError):
    """A model file that is missing, broken, hostile or not what its config says.

    Attributes:
        path: the file (or directory) at fault.
        problem: what is wrong with it, in words.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem
