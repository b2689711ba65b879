"""Load-test a model behind vLLM's OpenAI-compatible server, on loopback only.

The server is started with `--max-num-seqs` below the number of concurrent requests,
so requests queue in the engine, as they do under real load. The test sends a bounded
number of requests and stops by itself; it never targets anything but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import numpy as np

from posttrain.probe import free_port

HOST = "127.0.0.1"


@contextlib.contextmanager
def vllm_server(model_dir: str, *, kv_memory_bytes: int, context_length: int, max_num_seqs: int,
                dtype: str, startup_timeout: float = 300.0):
    """A vLLM OpenAI server for `model_dir` on a free loopback port; yields its base URL."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", HOST,
           "--port", str(port), "--kv-cache-memory-bytes", str(kv_memory_bytes), "--max-model-len",
           str(context_length), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype, "--enforce-eager",
           "--served-model-name", "posttrain"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}): {proc.stderr.read()[-800:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError(f"vLLM server did not become healthy within {startup_timeout:.0f} s")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def server_capacity(url: str) -> dict:
    """The engine's own KV capacity, from its cache config as the server publishes it on
    /metrics (`vllm:cache_config_info`, read with prometheus_client's parser): block size,
    number of blocks, KV cache tokens, maximum concurrency at the model length, dtypes."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    info = next((sample.labels for family in text_string_to_metric_families(text)
                 if family.name == "vllm:cache_config_info" for sample in family.samples), None)
    if info is None:
        raise RuntimeError(f"the vLLM server at {url} publishes no vllm:cache_config_info on /metrics")
    return {"block_size": int(info["block_size"]), "num_blocks": int(info["num_gpu_blocks"]),
            "kv_cache_tokens": int(info["kv_cache_size_tokens"]),
            "max_concurrency": float(info["kv_cache_max_concurrency"]), "kv_cache_dtype": info.get("cache_dtype", "")}


async def _send_all(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[dict]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(prompt: str) -> dict:
            async with gate:
                start = time.perf_counter()
                try:
                    resp = await client.post("/v1/completions", json={
                        "model": "posttrain", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0})
                    ok = resp.status_code == 200
                    tokens = resp.json()["usage"]["completion_tokens"] if ok else 0
                except httpx.HTTPError:
                    ok, tokens = False, 0
                return {"ok": ok, "seconds": time.perf_counter() - start, "tokens": tokens}
        return await asyncio.gather(*(one(p) for p in prompts))


def load_test(url: str, prompts: list[str], *, concurrency: int, max_tokens: int) -> dict:
    """Send every prompt (at most `concurrency` in flight); throughput and latency figures."""
    start = time.perf_counter()
    results = asyncio.run(_send_all(url, prompts, concurrency, max_tokens))
    wall = time.perf_counter() - start
    latencies = [r["seconds"] * 1000 for r in results if r["ok"]]
    return {"requests": len(results), "failed_requests": sum(not r["ok"] for r in results),
            "concurrency": concurrency, "wall_seconds": wall, "requests_per_second": len(latencies) / wall,
            "output_tokens_per_second": sum(r["tokens"] for r in results) / wall,
            **{f"latency_p{q}_ms": float(np.percentile(latencies, q, method="inverted_cdf")) if latencies else 0.0
               for q in (50, 95, 99)}}


async def _replay(url: str, tokenizer, env, rows: list[dict], *, concurrency: int, max_tokens: int,
                  limits) -> list[dict]:
    import httpx

    from posttrain.envs.tools import guard
    from posttrain.scoring.episodes import ended_reply, prompt_ids, start, stop_ids, take

    factory, stops = guard(env.episode, limits), stop_ids(tokenizer)
    max_turns, system = getattr(env, "max_turns", 8), getattr(env, "system", None)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def session(row: dict) -> dict:
            async with gate:
                episode, began = start(factory, row, system), time.perf_counter()
                requests, peak, ok = 0, 0, True
                while not episode.done:
                    ids = prompt_ids(tokenizer, episode)  # the whole conversation so far, as the model sees it
                    budget = max(1, max_tokens - episode.tokens)
                    try:
                        resp = await client.post("/v1/completions", json={
                            "model": "posttrain", "prompt": ids, "max_tokens": budget, "temperature": 0.0,
                            "return_token_ids": True, "stop_token_ids": stops, "skip_special_tokens": False})
                        requests += 1
                        choice = resp.json()["choices"][0] if resp.status_code == 200 else None
                    except (httpx.HTTPError, ValueError, KeyError, IndexError):
                        choice = None
                    if choice is None:
                        ok = False
                        break
                    reply = ended_reply(list(choice.get("token_ids") or []), choice.get("finish_reason"), stops)
                    peak = max(peak, len(ids) + len(reply))
                    take(tokenizer, episode, reply[:budget], ids, max_tokens=max_tokens, max_turns=max_turns)
                    if not episode.done and episode.tokens >= max_tokens:
                        episode.done = episode.truncated = True
                return {"ok": ok, "seconds": time.perf_counter() - began, "requests": requests, "peak_tokens": peak,
                        "turns": episode.turns, "tool_calls": episode.tool_calls, "tool_errors": episode.tool_errors,
                        "tokens": episode.tokens, "correct": ok and env.verify(episode.final, row["answer"])}
        return await asyncio.gather(*(session(r) for r in rows))


def session_load_test(url: str, tokenizer, env, rows: list[dict], *, concurrency: int, max_tokens: int,
                      limits) -> dict:
    """Replay one multi-turn session of a tool environment per row (at most `concurrency`
    at once): each turn sends the whole conversation so far (prompt, replies, tool results,
    as token ids the chat template renders), runs the tools the reply calls under `limits`,
    until the model answers or a cap (`max_tokens` for the whole episode, the env's turns)
    ends it; the serving check's session figures."""
    start_time = time.perf_counter()
    results = asyncio.run(_replay(url, tokenizer, env, rows, concurrency=concurrency, max_tokens=max_tokens,
                                  limits=limits))
    wall = time.perf_counter() - start_time
    done = [r for r in results if r["ok"]]
    latencies = [r["seconds"] * 1000 for r in done]
    count = max(1, len(done))
    return {"sessions": len(results), "failed_sessions": len(results) - len(done), "concurrency": concurrency,
            "wall_seconds": wall, "sessions_per_second": len(done) / wall,
            "requests": sum(r["requests"] for r in results),
            "turns_per_session": sum(r["turns"] for r in done) / count,
            "correct_rate": sum(r["correct"] for r in done) / count,  # the served episodes' verdicts
            "tool_calls_per_session": sum(r["tool_calls"] for r in done) / count,
            "tool_errors_per_session": sum(r["tool_errors"] for r in done) / count,
            "episode_tokens_per_second": sum(r["tokens"] for r in done) / wall,  # replies and tool results
            "peak_session_tokens": max((r["peak_tokens"] for r in results), default=0),
            **{f"session_latency_p{q}_ms": float(np.percentile(latencies, q, method="inverted_cdf")) if latencies
               else 0.0 for q in (50, 95, 99)}}
