"""`kvbench serve`: our GPT-2 behind an OpenAI-compatible HTTP server, with a serving cache across requests.

Modules, bottom up:
    pool.py      the paged KV pool every request shares: blocks, reference counts, the prefix cache (block hashes
                 chained on the parent's), LRU eviction of unreferenced cached blocks, the optional host tier
    batch.py     one forward step of a running batch over the pool: a LayerCache per layer (key_positions)
    engine.py    the request queue and the continuous-batching loop (one thread), sampling, logprobs
    protocol.py  the OpenAI documents: a completion request read and checked, responses, chunks, errors, metrics
    faults.py    SERVER_FAULTS: buggy pools chosen by `--fault`
    scenarios.py the serving checks in process (warm, host-hit, shared-prefix, ...), and `break NAME` for a fault
    rules.py     serve's options checked before any work, and the pool against the memory there is
    app.py       the FastAPI application and the uvicorn server (the only module that imports either)
"""
