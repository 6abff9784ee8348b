"""serve/request_progress.py: the servers add up the engine's delta updates; a cumulative output read later still
shows the request as of its own update."""

from __future__ import annotations

from kiln.runtime.core.outputs import RequestOutput
from kiln.serve.request_progress import RequestProgress


def _delta(tokens, text, logprobs=None, finish_reason=None, prompt_logprobs=None):
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], token_ids=tokens, text=text,
                         finish_reason=finish_reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                         num_cached_tokens=0)


def test_outputs_are_cumulative_as_of_their_own_update():
    progress = RequestProgress()
    first = progress.add(_delta([5], "he", [-0.5], prompt_logprobs=[None, -1.0]))
    second = progress.add(_delta([6, 7], "llo", [-0.25, -0.125]))
    last = progress.add(_delta([8], " you", [-1.0], finish_reason="stop"))
    # read after later updates arrived: each still shows its own point
    assert (first.token_ids, first.text, first.logprobs, first.finished) == ([5], "he", [-0.5], False)
    assert (second.token_ids, second.text, second.logprobs) == ([5, 6, 7], "hello", [-0.5, -0.25, -0.125])
    assert (last.token_ids, last.text, last.finish_reason, last.finished) == ([5, 6, 7, 8], "hello you", "stop", True)
    assert last.prompt_logprobs == [None, -1.0] and last.prompt_token_ids == [1, 2] and last.request_id == "r"
    assert last.top_logprobs is None


def test_no_logprobs_asked_reads_as_none():
    progress = RequestProgress()
    out = progress.add(_delta([5, 6], "ab"))
    assert out.logprobs is None and out.top_logprobs is None and out.text == "ab"


def test_an_update_without_text_keeps_the_text():
    progress = RequestProgress()
    progress.add(_delta([5], "a"))
    held = progress.add(_delta([6], ""))  # text held back (a stop string might still cut it)
    assert held.text == "a" and held.token_ids == [5, 6]
