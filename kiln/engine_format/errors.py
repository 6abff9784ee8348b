"""The one error type of engine loading."""


class EngineError(Exception):
    """An engine directory that cannot be loaded; the message says what differs and what to do."""
