"""A running OpenAI-compatible server seen from outside: `kvbench verify --endpoint URL` checks its cross-request
KV-cache reuse, `kvbench bench --endpoint URL` times it (stream.py).

client.py speaks HTTP (standard library only, every call bounded by --timeout, every failure one line); resets.py
holds the ways an engine forgets its prefix cache; engine.py probes what a server exposes; completion.py reads its
answers; compare.py judges a warm run against a cold one; checks.py and accounting.py are the checks; run.py runs
the ones asked for and returns verify's rows. stream.py is client.py's Client reading a streamed completion event
by event, each token's arrival timed, for bench."""
