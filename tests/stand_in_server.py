"""A stand-in for an OpenAI-compatible completions server (`vllm serve`'s protocol: `/v1/models`, `/tokenize`,
`/v1/completions` with `return_token_ids`), its completions drawn by our own Sampler from the model it serves, with
seeds of each request's prompt and temperature. In a thread of a test (StandIn), or as a command a round starts:
`python tests/stand_in_server.py MODEL_DIR PORT` serves MODEL_DIR under its path until it is stopped."""

import json
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import transformers

from generation.sampling import Sampler
from modeling.distributed import Topology


class Listening(ThreadingHTTPServer):
    request_queue_size = 64  # a round's requests at once (the default backlog is 5)


class StandIn:
    """A server of the model at `model_dir` under the name `served`; `answer` may replace a completions answer."""

    def __init__(self, model_dir: Path, served: str, tokenizer_dir: Path | None = None, port: int = 0):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
        self.served, self.answer, self.delay, self.sent = served, None, 0.0, []
        self.lock = threading.Lock()  # one model, requests in threads: one draw at a time
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: dict | bytes, code: int = 200):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"object": "list", "data": [{"id": stand_in.served, "root": stand_in.served}]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(stand_in.delay)
                if self.path == "/tokenize":
                    ids = stand_in.tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
                    return self.reply({"tokens": ids, "count": len(ids)})
                self.reply(stand_in.answer(request) if stand_in.answer else stand_in.complete(request))

        self.http = Listening(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, request: dict) -> dict:
        with self.lock:
            answer = completions(self.model, self.tokenizer, request)
            self.sent += [choice["drawn"] for choice in answer["choices"]]
        return answer


def completions(model, tokenizer, request: dict) -> dict:
    """The answer to a completions request: n completions drawn by our own loop at the request's temperature, the EOS
    left out of the ids (as some servers answer: finish_reason says it stopped); each choice's `drawn` holds the ids
    as drawn, with the EOS."""
    sampler = Sampler(tokenizer, Topology.create("BasicTrainer"), request["max_tokens"], 16)
    n, eos = request["n"], tokenizer.eos_token_id
    first = zlib.crc32(json.dumps([request["prompt"], request["temperature"]]).encode()) * 1000
    seeds = list(range(first, first + n))  # of the request, not of its arrival: concurrent requests interleave
    drawn = sampler.sample(model, [request["prompt"]] * n, None, seeds, request["temperature"], request.get("top_p", 1))
    stopped = [ids[-1:] == [eos] for ids in drawn]
    choices = [{"index": i, "token_ids": ids[:-1] if stop else ids, "finish_reason": "stop" if stop else "length",
                "drawn": ids} for i, (ids, stop) in enumerate(zip(drawn, stopped))]  # fmt: skip
    return {"choices": choices}


if __name__ == "__main__":
    torch.set_num_threads(1)
    StandIn(Path(sys.argv[1]), sys.argv[1], port=int(sys.argv[2]))
    threading.Event().wait()
