"""What the doctor reports: one Finding per check, each with a status and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Worst last: the exit code is 1 when any finding is "fail".
STATUSES = ("ok", "info", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """One check's result.

    Args:
        check: a dotted name ("local_dir.odirect").
        status: ok (works), info (a fact, nothing to do), warn (works, but slower or riskier
            than it should be), fail (cannot work as asked).
        summary: what was found, with the numbers.
        fix: what to do about it (None when nothing is needed).
        data: the measured values, for ``--json``.
    """

    check: str
    status: str
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} is not one of {STATUSES}")


@dataclass(frozen=True)
class Diagnosis:
    """All findings, and what ``auto`` would pick for CPU and (when there is a GPU) CUDA states."""

    findings: tuple[Finding, ...]
    auto: dict[str, str]

    @property
    def failed(self) -> bool:
        return any(f.status == "fail" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0
