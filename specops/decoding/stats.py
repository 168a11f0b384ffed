"""What a decode call did and where its time went."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Stats"]


@dataclass
class Stats:
    """What a decode call did and where its time went."""

    new_tokens: int = 0
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    forward_seconds: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)
    member_calls: list[int] | None = None  # forwards of each ensemble member (target_calls is their sum)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def overhead_fraction(self) -> float:
        """Share of the wall time spent outside model forward passes."""
        return max(0.0, self.seconds - self.forward_seconds) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        text = (f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s), "
                f"target calls {self.target_calls} ({self.target_calls_per_token:.2f}/token)")
        if self.member_calls:
            text += " = " + " + ".join(str(c) for c in self.member_calls) + " by member"
        if self.drafted:
            text += (f", drafter calls {self.drafter_calls}" if self.drafter_calls else "")
            text += (f", accepted {self.accepted}/{self.drafted} "
                     f"({self.acceptance:.0%})")
        text += (f", time: prefill {self.prefill_seconds:.2f} s, draft {self.draft_seconds:.2f} s, "
                 f"verify {self.verify_seconds:.2f} s, other {self.other_seconds:.2f} s, "
                 f"outside forwards {self.overhead_fraction:.1%}")
        return text
