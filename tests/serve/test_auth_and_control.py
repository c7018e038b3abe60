"""Secure by default: every route wants the key; the control routes are off unless
``--enable-rl-endpoints``; the server listens on the loopback interface only."""

from __future__ import annotations

import httpx
import pytest
from serve_kit import API_KEY

#: every control route, with a body it would accept were it enabled
CONTROL_ROUTES = [
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("POST", "/sleep?level=1", None),
    ("POST", "/wake_up", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": "skyrl_finish_weight_update"}),
]
GUARDED = ["/health", "/metrics", "/v1/models", "/server_info", "/no/such/route"]


@pytest.mark.parametrize("path", GUARDED)
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic dGVzdDp0ZXN0",
                                    f"Bearer {API_KEY}x", API_KEY],
                         ids=["missing", "wrong", "basic", "longer", "no_scheme"])
def test_every_route_wants_the_key(server, path, header) -> None:
    headers = {"Authorization": header} if header else {}
    response = httpx.get(server.url + path, headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    message = response.json()["error"]["message"]
    if header is None:
        assert "the API key is missing" in message
    elif header.startswith("Bearer "):
        assert "the API key is wrong" in message
    else:  # a key without the scheme is not called wrong: the header's form is
        assert "must be 'Bearer <key>'" in message and "wrong" not in message
        assert API_KEY not in message  # nothing of the header is echoed


def test_the_key_from_the_environment_is_required(locked_server) -> None:
    assert httpx.get(locked_server.url + "/v1/models", timeout=30).status_code == 401
    wrong = {"Authorization": f"Bearer {API_KEY}"}  # the other server's key
    assert httpx.get(locked_server.url + "/v1/models", headers=wrong,
                     timeout=30).status_code == 401
    with locked_server.client() as client:
        assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_ROUTES,
                         ids=[p for _, p, _ in CONTROL_ROUTES])
def test_control_routes_are_off_without_the_flag(locked_server, method, path, body) -> None:
    with locked_server.client() as client:
        response = client.request(method, path, json=body)
        assert response.status_code == 403, response.text
        assert "--enable-rl-endpoints" in response.json()["error"]["message"]
        # and nothing changed: it still generates
        ok = client.post("/generate", json={"input_ids": [1, 2],
                                            "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200, ok.text


def test_the_reads_stay_open_without_the_flag(locked_server) -> None:
    with locked_server.client() as client:
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert client.get("/is_paused").json() == {"is_paused": False}
        info = client.get("/server_info").json()
        assert info["enable_rl_endpoints"] is False and info["api_key_set"] is True
        assert API_KEY not in str(info)


def test_it_listens_on_loopback_only(server) -> None:
    assert server.url.startswith("http://127.0.0.1:")


def test_metrics_report_the_engine(server) -> None:
    with server.client() as client:
        assert client.post("/generate", json={"input_ids": [4, 5], "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}}).status_code == 200
        text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("kvrunner_num_requests_running", "kvrunner_num_requests_waiting",
                 "kvrunner_kv_blocks_used", "kvrunner_kv_blocks_total",
                 "kvrunner_step_seconds", "kvrunner_sleep_level", "kvrunner_paused",
                 "kvrunner_nonfinite_rows_total", "kvrunner_requests_aborted_total"):
        assert name in values, (name, text)
    assert values["kvrunner_generation_tokens_total"] >= 3
    assert values["kvrunner_prompt_tokens_total"] >= 2
    assert values["kvrunner_kv_blocks_total"] > 0
    assert any(k.startswith("kvrunner_weight_info{") for k in values)
