"""The serving wing: what the `lmcache` engine (vLLM + LMCache) needs around it.

- `completion`: the streaming completion client (vLLM's OpenAI-compatible `/v1/completions`, SSE);
- `probes`: HTTP checks of both servers (`ServerError` says how to start them);
- `kvlayout`: LMCache's fused K/V block layouts to and from `[2, L, T, D]`;
- `servers`: start, watch and stop vLLM and LMCache processes (the server test tier, `tdutils doctor`);
- `venvs`: the separate venvs of packages that pin another torch or transformers (vLLM + LMCache, the peers);
- `patches`: the vLLM / LMCache patches that export query tensors (`python -m tdutils patches`).
"""
