"""`kvbench verify --endpoint URL`: cross-request KV-cache reuse checked on any OpenAI-compatible server.

client.py speaks HTTP (standard library only, every call bounded by --timeout, every failure one line); resets.py
holds the ways an engine forgets its prefix cache; engine.py probes what a server exposes; completion.py reads its
answers; compare.py judges a warm run against a cold one; checks.py and accounting.py are the checks; run.py runs
the ones asked for and returns verify's rows."""
