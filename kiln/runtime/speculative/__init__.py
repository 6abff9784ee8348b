"""Speculative decoding: proposers (a draft model, n-gram lookup, an EAGLE-3 head) behind one seam, the
rejection rule, and the acceptance counters. The engine asks for drafts before each schedule, verifies them
in one target step (1 + K positions per request) and keeps the longest accepted prefix plus one token of the
target's.

Only the config is imported here: the sampler imports `speculative.rejection`, and the proposers import
the sampler."""

from kiln.runtime.speculative.config import SpeculativeConfig, speculative_config_of

__all__ = ["SpeculativeConfig", "speculative_config_of"]
