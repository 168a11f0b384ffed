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
    method: str = ""  # the method that ran (what "auto" chose)
    scheme: str = ""  # how sampled drafts were verified (option "scheme", "auto" resolved; "" when greedy or none)
    scheme_reason: str = ""  # why that scheme: "asked for", or what "auto" went by
    requests: int = 0
    request_steps: int = 0  # over the target's forwards (the prefill included), the requests each one read

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
    def tokens_per_request_step(self) -> float:
        """The speculative gain: tokens a request gets from one target forward (1 for plain decoding;
        batching does not change it)."""
        return self.new_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def requests_per_step(self) -> float:
        """The batching gain: requests one target forward serves, on average (finished ones leave)."""
        return self.request_steps / (self.steps + 1) if self.request_steps else 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def overhead_fraction(self) -> float:
        """Share of the wall time spent outside model forward passes."""
        return max(0.0, self.seconds - self.forward_seconds) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        head = f"{self.method}: " if self.method else ""
        if not self.new_tokens:
            return head + ("no tokens generated (max_new_tokens 0, or every request stopped before its first "
                           "token)")
        text = (f"{head}{self.new_tokens} tokens in {self.seconds:.2f} s "
                f"({self.tokens_per_second:.1f} tok/s); speculation "
                f"{self.tokens_per_request_step:.2f} tokens per request per target step (1 without), "
                f"batching {self.requests_per_step:.2f} requests per step; "
                f"target calls {self.target_calls} ({self.target_calls_per_token:.2f}/token)")
        if self.member_calls:
            text += " = " + " + ".join(str(c) for c in self.member_calls) + " by member"
        if self.drafted:
            text += (f", drafter calls {self.drafter_calls}" if self.drafter_calls else "")
            text += (f", accepted {self.accepted}/{self.drafted} "
                     f"({self.acceptance:.0%})")
        if self.scheme:
            text += f"; verified by scheme {self.scheme} ({self.scheme_reason})"
        text += (f"; time: prefill {self.prefill_seconds:.2f} s, draft {self.draft_seconds:.2f} s, "
                 f"verify {self.verify_seconds:.2f} s, other {self.other_seconds:.2f} s, "
                 f"outside forwards {self.overhead_fraction:.1%}")
        return text
