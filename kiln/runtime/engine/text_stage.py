"""The engine's last stage: the tokens a step read back, turned into text (ending requests that complete a
stop string) and into the step's updates (`RequestOutput`s). `LLMEngine.step` runs it while the GPU computes
the next step; the engine keeps the requests, this stage only the tokens waiting for their text."""

from __future__ import annotations

from collections.abc import Callable

from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.request import RequestStatus
from kiln.runtime.core.request_failure import RequestFailure
from kiln.runtime.engine.tracked_request import TrackedRequest


class TextStage:
    """Tokens read back but not yet turned into text, and `emit`, which turns them into text and updates."""

    def __init__(self) -> None:
        # (request, token, its index among the request's output tokens, whether the token adds text)
        self._pending: list[tuple[TrackedRequest, int, int, bool]] = []

    def __bool__(self) -> bool:
        """Whether tokens wait for their text."""
        return bool(self._pending)

    def add(self, tracked: TrackedRequest, token: int, index: int, adds_text: bool) -> None:
        """Queues a kept token: its text is added by the next `emit`."""
        self._pending.append((tracked, token, index, adds_text))

    def drop(self, tracked: TrackedRequest, add_text: bool = False) -> None:
        """Forgets a request's waiting tokens; with `add_text` adds their text first (an aborted request's
        final output shows them)."""
        mine = [item for item in self._pending if item[0] is tracked]
        if mine:
            self._pending = [item for item in self._pending if item[0] is not tracked]
        if add_text:
            for _, token, _, adds_text in mine:
                if adds_text:
                    tracked.detokenizer.add_token(token)

    def emit(self, final_only: bool, stop: Callable[[str], None],
             fail: Callable[[TrackedRequest], None]) -> list[RequestOutput]:
        """Adds the waiting tokens' text (ending requests that complete a stop string) and builds one update
        per request that advanced: several tokens of one step (verified drafts) go out together, so only the
        last update of a request is marked finished. With `final_only`, updates of finished requests only.
        Something that goes wrong for one request (its text cannot be decoded) ends that request alone.

        The engine ends the requests (passed per call: the stage holds no reference to the engine):
        `stop(request_id)` ends a running request that completed a stop string (FINISHED_STOPPED);
        `fail(tracked)` ends one whose `failure` is set and queues its final update."""
        pending, self._pending = self._pending, []
        advanced: dict[TrackedRequest, int] = {}  # request -> index of its last token that counts
        for tracked, token, index, add_text in pending:
            if tracked.failure is not None:
                continue
            try:
                if _add_text(tracked, token, index, add_text, final_only, stop):
                    advanced[tracked] = index
            except Exception as e:  # kiln's fault, for this request only
                tracked.failure = RequestFailure(f"internal error while decoding the output: {e!r}")
                advanced.pop(tracked, None)
                fail(tracked)
        outputs = []
        for tracked, index in advanced.items():
            request = tracked.request
            last = request.status.finished and index == len(request.output_token_ids) - 1
            if (final_only or request.sampling_params.output_kind == "final_only") and not last:
                continue
            outputs.append(tracked.output(index + 1))
        return outputs


def _add_text(tracked: TrackedRequest, token: int, index: int, add_text: bool, final_only: bool,
              stop: Callable[[str], None]) -> bool:
    """Adds a token's text, ending the request if it completes a stop string; False for a token after a
    stop string that ended its request within the same step (it was dropped)."""
    request = tracked.request
    if index >= len(request.output_token_ids):
        return False
    final_only = final_only or request.sampling_params.output_kind == "final_only"
    last = request.status.finished and index == len(request.output_token_ids) - 1
    if add_text and final_only and not last and not request.sampling_params.stop:
        # Nobody reads this text before the request ends and no stop string is searched for: decode it
        # then, all at once, rather than twice per token (most of the host's work per request and step).
        tracked.detokenizer.defer(token)
        return True
    if add_text and tracked.detokenizer.add_token(token) is not None:
        # Tokens sampled after the stop string in the same step are dropped.
        for values in (request.output_token_ids, tracked.logprobs, tracked.top_logprobs, tracked.generation_logits):
            if values is not None:
                del values[index + 1:]
        if request.status.finished:  # ended by its length with this very token: the stop string wins
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            stop(request.request_id)
    return True
