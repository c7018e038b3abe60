"""The data and control calls of SkyRL's ``RemoteInferenceClient`` (NovaSky-AI/SkyRL
a9564572eb8e91076be43c1bd5e4615e3de17265,
``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``), each
posted as it posts it: ``generate`` to ``/inference/v1/generate`` (one prompt per
request, the generator's sampling params from ``engine_utils.get_vllm_sampling_params``
at SkyRL's defaults, ``cache_salt``, the ``X-Session-ID`` header), ``tokenize`` /
``detokenize`` one text each, ``get_world_size`` (a GET with a JSON ``{}``), and the
control plane's query-string calls around a weight sync (``/pause?mode=keep&
clear_cache=false``, ``/sleep?level=2``, ``/wake_up?tags=...``, ``/resume``,
``/reset_prefix_cache`` with its JSON body), and ``sample``'s Tinker body. The tokens
and logprobs equal ``LLM.generate``'s."""

from __future__ import annotations

import math

from kvrunner import SamplingParams


def skyrl_sampling_params(max_tokens: int) -> dict[str, object]:
    """``get_vllm_sampling_params`` at SkyRL's ``SamplingParams`` defaults (greedy)."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
            "min_p": 0.0, "logprobs": 1, "stop": None}


def test_skyrls_generate_gives_llm_generates_tokens_and_logprobs(server, reference_llm
                                                                 ) -> None:
    prompt = [5, 9, 14, 3, 7]
    with server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/inference/v1/generate", headers={"X-Session-ID": "traj-1"}, json={
            "sampling_params": skyrl_sampling_params(8), "model": model,
            "token_ids": prompt, "cache_salt": "3"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    want = reference_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                           min_tokens=1, logprobs=1))[0]
    assert choice["token_ids"] == want.token_ids
    assert choice["finish_reason"] in ("length", "stop")
    got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in
               zip(got, want.logprobs, strict=True))


def test_skyrls_tokenize_detokenize_and_world_size(server) -> None:
    with server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        tokens = client.post("/tokenize", json={"model": model, "prompt": "hello world",
                                                "add_special_tokens": True}).json()["tokens"]
        assert tokens
        text = client.post("/detokenize", json={"model": model, "tokens": tokens}).json()
        assert text["prompt"] == "hello world"
        size = client.request("GET", "/get_world_size", json={})
        assert size.status_code == 200 and size.json()["world_size"] == 1


def test_skyrls_control_calls_around_a_weight_sync(server) -> None:
    with server.client() as client:
        for path, params, body in [
            ("/pause", {"mode": "keep", "clear_cache": "false"}, None),
            ("/sleep", {"level": "2"}, None),
            ("/wake_up", {"tags": ["weights"]}, None),
            ("/wake_up", {"tags": ["kv_cache"]}, None),
            ("/reset_prefix_cache", None, {"reset_running_requests": True}),
            ("/resume", None, None),
        ]:
            r = client.post(path, params=params, json=body)
            assert r.status_code == 200, (path, r.text)
        assert client.get("/is_paused").json() == {"is_paused": False}
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_skyrls_tinker_sample_body_is_served(server) -> None:
    """``sample``: ``n`` samples, ``logprobs: 0``, ``output_kind: 2`` (final only),
    ``prompt_logprobs`` unset, the Tinker fields mapped to vLLM's."""
    with server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/inference/v1/generate", json={"sampling_params": {
            "n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": None,
            "temperature": 1.0, "max_tokens": 4, "seed": 11, "stop_token_ids": [0]},
            "model": model, "token_ids": [4, 8, 15]})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 2
        for choice in choices:
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
