"""The runtime's torch-free core: scheduler, block manager, block table, requests, sampling parameters,
outputs, the guided-decoding spec and request failures. Plain Python, tested without a device; nothing
here imports torch or another runtime layer."""
