"""The engine and its callers: `LLMEngine` (the step loop), tracked requests and the detokenizer, the
factory that assembles an engine from an engine directory, `LLM`, `AsyncLLM`, kernel warm-up and the
startup log."""
