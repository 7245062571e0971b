"""Sampling handed to a server: an OpenAI-compatible completions endpoint (`vllm serve`, SGLang) that serves the
candidate. It is sent prompt token ids, a temperature, top_p, how many completions and max tokens, and answers token
ids; everything after sampling (the KL's log-probs, judging, win rates, figures) stays ours, so the numbers do not
depend on the server's kernels. The served model is checked first: its name or path (`/v1/models`) and its
vocabulary (`/tokenize` of a probe text against our tokenizer's ids). Every failure is one line naming the URL. The
URL is a base one (`http://host:8000`), or as OpenAI clients take it (`http://host:8000/v1`), or as `vllm serve`
prints it (`localhost:8000`: http:// is added, and said).

The server's draws are its own: not reproducible from our seeds (a per-request seed fails on vLLM's CPU backend),
which is why the own loop stays the default."""

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tqdm

from utils import UserError

# Text whose ids tell tokenizers apart: words, digits, punctuation, spacing, a chat turn's marks, non-ASCII letters
PROBE = "Hello, world! 12,345 tokens: don't\n\t<|im_start|>user ¿Qué tal? Привет 你好 🙂 end."
# Requests in flight at once: the server batches the rows of concurrent requests
CONCURRENT = 32


class ServerSampler:
    """Completions of prompts from the model an OpenAI-compatible server at `url` serves (check() first)."""

    def __init__(self, url: str, tokenizer, max_new_tokens: int, timeout: float, topology, setting: str = "server"):
        self.url, self.tokenizer, self.topology = self.check_url(setting, url), tokenizer, topology
        if "://" not in url and topology.is_main:
            print(f"{setting}={url} names no scheme: asking {self.url}")
        self.max_new_tokens, self.timeout = max_new_tokens, timeout
        self.setting = setting  # the key that asked for the server (evaluate.py's server, rounds.server), for errors
        self.model_id: str | None = None

    @staticmethod
    def check_url(key: str, url: str | None) -> str | None:
        """The base URL of the server that key=url names (None for none), to which the routes are appended: http://
        added where it names no scheme (urllib takes `localhost:8000`'s host for one), a trailing /v1 and slash
        left out. One line where it is no http(s) URL of a host."""
        if url is None:
            return None
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        try:
            usable = parts.scheme in ("http", "https") and parts.hostname and parts.port != 0
        except ValueError:  # a port that is no number, or out of range
            usable = False
        if not usable or parts.query or parts.fragment:
            raise UserError(f"{key}={url} is not an http(s):// URL of a host; give e.g. {key}=http://localhost:8000")
        return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/").removesuffix("/v1")))

    def request(self, path: str, payload: dict | None = None) -> dict:
        """The JSON answer to a GET (payload None) or a POST of `payload` at path; one line for any failure."""
        where = f"generation server {self.url}{path}"
        late = f"{where} gave no answer within {self.timeout:g} s ({self.setting}_timeout)"
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            try:
                detail = " ".join(error.read().decode(errors="replace").split())[:200]
            except (http.client.HTTPException, OSError):  # an error page cut short: its status says enough
                detail = ""
            raise UserError(f"{where} answered HTTP {error.code}: {detail or error.reason}") from None
        except (TimeoutError, socket.timeout):
            raise UserError(late) from None
        except http.client.HTTPException as error:  # e.g. BadStatusLine: something else listens there
            raise UserError(f"{where} answered no HTTP ({error!r:.200}); is it an OpenAI-compatible server?") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise UserError(late) from None
            raise UserError(f"{where} is unreachable ({reason!s:.200}); start it, or set {self.setting}=null") from None
        with response:
            try:
                body = response.read()
            except (TimeoutError, socket.timeout):
                raise UserError(late) from None
            except (http.client.HTTPException, OSError) as error:  # e.g. IncompleteRead: it stopped mid-answer
                raise UserError(f"{where} broke off its answer ({error!r:.200}); did it stop or crash?") from None
        try:
            return json.loads(body)
        except ValueError:
            raise UserError(f"{where} answered something that is not JSON: {body[:120]!r}") from None

    def check(self, spec: str) -> None:
        """The served model must be the candidate `spec`: one it serves names it, by its id or root (vLLM's --model),
        as given or as the same directory; and it must tokenize the probe as ours does. Says which it samples."""
        answer = self.request("/v1/models")
        served = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(served, list) or not served:
            raise UserError(f"generation server {self.url}/v1/models lists no model: {str(answer)[:200]}")
        here = Path(spec).resolve() if Path(spec).exists() else None
        for entry in served:
            names = [entry.get(key) for key in ("id", "root") if isinstance(entry.get(key), str)]
            if any(name == spec or (here is not None and Path(name).resolve() == here) for name in names):
                self.model_id = entry.get("id")
                break
        else:
            listed = ", ".join(str(entry.get("id")) for entry in served)
            raise UserError(f"generation server {self.url} serves {listed}, not the candidate {spec}: serve it there")
        ours = self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        theirs = self.request("/tokenize", {"model": self.model_id, "prompt": PROBE, "add_special_tokens": False})
        if not isinstance(theirs, dict) or theirs.get("tokens") != ours:
            raise UserError(
                f"generation server {self.url} tokenizes otherwise than {spec}'s tokenizer (its ids of a probe text: "
                f"{str(theirs.get('tokens') if isinstance(theirs, dict) else theirs)[:80]}, ours {str(ours)[:80]}): "
                "it serves another vocabulary"
            )
        if self.topology.is_main:
            print(f"sampling: the generation server {self.url} ({self.model_id}); log-probs ours")

    def completions(self, prompt: list[int], n: int, temperature: float, top_p: float) -> list[list[int]]:
        """n completions of one prompt at `temperature`: each the new ids, ending with the EOS where it stopped."""
        payload = {
            "model": self.model_id, "prompt": prompt, "n": n, "temperature": temperature, "top_p": top_p,
            "max_tokens": self.max_new_tokens, "return_token_ids": True,
        }  # fmt: skip
        choices = self.request("/v1/completions", payload).get("choices")
        where = f"generation server {self.url}/v1/completions"
        if not isinstance(choices, list) or len(choices) != n:
            raise UserError(f"{where} answered {len(choices) if isinstance(choices, list) else 'no'} choices for n={n}")
        eos = self.tokenizer.eos_token_id
        drawn = []
        for choice in choices:
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < len(self.tokenizer) for i in ids):
                raise UserError(f"{where} answered a choice without valid token_ids: {str(choice)[:200]}")
            if len(ids) > self.max_new_tokens:
                raise UserError(f"{where} answered {len(ids)} tokens for max_tokens={self.max_new_tokens}")
            if choice.get("finish_reason") == "stop" and (not ids or ids[-1] != eos):
                ids = [*ids, eos]  # stopped at the EOS, which some servers leave out of the ids
            elif choice.get("finish_reason") not in ("stop", "length"):
                raise UserError(f"{where} answered finish_reason={choice.get('finish_reason')!r}: a truncated answer")
            drawn.append(ids)
        return drawn

    def sample(self, prompts: list[list[int]], temperatures: list[float], top_p: float) -> list[list[int]]:
        """Completions of rows (prompt, temperature): each data-parallel rank asks for its share (sample_here),
        gathered in order on every rank."""
        local, n_real = self.topology.shard(list(range(len(prompts))))
        drawn = self.sample_here([prompts[i] for i in local[:n_real]], [temperatures[i] for i in local[:n_real]], top_p)
        return self.topology.gather({"results": drawn})["results"]

    def sample_here(self, prompts: list[list[int]], temperatures: list[float], top_p: float) -> list[list[int]]:
        """Completions of rows (prompt, temperature) asked for by this process alone: one request per distinct pair
        with n its rows, CONCURRENT at a time, with a progress bar."""
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(zip(map(tuple, prompts), temperatures)):
            groups.setdefault(row, []).append(i)
        drawn: dict[int, list[int]] = {}
        bar = tqdm.tqdm(total=len(prompts), desc="sampling (server)", unit="row", leave=False, dynamic_ncols=True,
                        disable=not self.topology.is_main)  # fmt: skip
        with bar, ThreadPoolExecutor(CONCURRENT) as pool:
            answers = pool.map(lambda item: self.completions(list(item[0][0]), len(item[1]), item[0][1], top_p),
                               groups.items())  # fmt: skip
            for rows, answer in zip(groups.values(), answers):
                drawn.update(zip(rows, answer))
                bar.update(len(rows))
        return [drawn[i] for i in range(len(prompts))]
