"""The server URL as users write it (issue 70, item 3): as `vllm serve` prints it (`localhost:8000`, no scheme: http://
is added, and said once), as OpenAI clients take it (`http://host:8000/v1`, `/v1/`), one that is no http(s) URL of a
host (one line at config time), and a server whose answer stops mid-body (one line naming the URL)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import config as configuration
from conftest import arithmetic_pairs, save_tiny_lm, write_jsonl
from generation.server_sampling import ServerSampler
from modeling.distributed import Topology
from stand_in_server import StandIn
from test_evaluate import LOWERCASE, run_evaluation
from utils import UserError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("urls")
    return save_tiny_lm(root / "model", "llama"), write_jsonl(root / "pairs.jsonl", arithmetic_pairs(40))


def test_a_url_as_vllm_prints_it_with_v1_reaches_the_server_and_says_http_once(tiny, tmp_path, capsys):
    # `localhost:8000` is urllib's scheme "localhost" and path "8000"; `/v1/` would ask /v1/v1/models
    model_dir, pairs = tiny
    port = StandIn(model_dir, str(model_dir)).http.server_address[1]
    settings = (f"candidates=[{model_dir}]", "baseline=chosen", f"judge={LOWERCASE}", f"server=localhost:{port}/v1/",
                "n_prompts=2", "samples_per_prompt=2", "temperatures=[1.0]")  # fmt: skip
    _, lines = run_evaluation(tmp_path, pairs, *settings)
    printed = capsys.readouterr().out
    assert printed.count("names no scheme") == 1
    assert f"server=localhost:{port}/v1/ names no scheme: asking http://localhost:{port}\n" in printed
    assert f"sampling: the generation server http://localhost:{port} ({model_dir}); log-probs ours" in printed
    assert len(lines) == 2 * 2


@pytest.mark.parametrize("given, base", [
    ("http://box:8000", "http://box:8000"), ("http://box:8000/", "http://box:8000"),
    ("http://box:8000/v1", "http://box:8000"), ("HTTP://box:8000/v1/", "http://box:8000"),
    ("https://box/proxy/v1", "https://box/proxy"), ("box:8000", "http://box:8000"),
    ("localhost:8000/v1", "http://localhost:8000"), ("my-vllm-box", "http://my-vllm-box"),
])  # fmt: skip
def test_a_server_url_is_its_base_once(given, base):
    assert ServerSampler(given, None, 4, 5.0, Topology.create("BasicTrainer")).url == base


def test_a_url_without_scheme_of_nothing_listening_is_one_line_naming_it():
    # before: `ValueError: unknown url type` (no scheme) rather than the server's unreachability
    with pytest.raises(UserError) as refused:
        ServerSampler("127.0.0.1:1", None, 4, 5.0, Topology.create("BasicTrainer")).check("model")
    assert str(refused.value).startswith("generation server http://127.0.0.1:1/v1/models is unreachable (")
    assert str(refused.value).endswith("); start it, or set server=null") and "\n" not in str(refused.value)


@pytest.mark.parametrize("url", ["ftp://box:8000", "http://", "http://:8000", "http://box:port", "box:99999",
                                 "http://box:8000/v1?key=1"])  # fmt: skip
def test_a_server_url_that_is_no_http_url_of_a_host_is_one_line_at_config_time(tmp_path, url):
    args = ["candidates=[org/model]", f"judge={LOWERCASE}", f"local_dirs=[{tmp_path}]", f"server={url}"]
    with pytest.raises(UserError) as refused:
        configuration.load(args, "evaluate")
    assert str(refused.value) == (
        f"server={url} is not an http(s):// URL of a host; give e.g. server=http://localhost:8000"
    )


@pytest.mark.parametrize("answer, said", [
    (b'HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{"data": [', "broke off its answer (IncompleteRead(10 bytes "
     "read, 90 more expected)); did it stop or crash?"),
    (b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 100\r\n\r\nTraceback", "answered HTTP 500: Internal "
     "Server Error"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "answered no HTTP (BadStatusLine('SSH-2.0-OpenSSH_9.6\\r\\n')); is it an "
     "OpenAI-compatible server?"),
])  # fmt: skip
def test_an_answer_cut_mid_body_or_not_http_is_one_line_naming_the_url(answer, said):
    # a tiny threaded server that reads the request and writes `answer` as it is: a Content-Length above the bytes
    # sent, then the connection closes (a server that crashed, a proxy that gave up); or no HTTP at all
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.wfile.write(answer)

    cut = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=cut.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{cut.server_address[1]}"
    try:
        with pytest.raises(UserError) as refused:
            ServerSampler(url, None, 4, 5.0, Topology.create("BasicTrainer")).check("model")
    finally:
        cut.shutdown()
        cut.server_close()
    assert str(refused.value) == f"generation server {url}/v1/models {said}"
