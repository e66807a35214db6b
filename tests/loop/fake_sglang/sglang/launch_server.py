"""``python -m sglang.launch_server`` for tests: a small HTTP server that parses SGLang's launch flags
(unknown flags exit 2, as SGLang's parser does), answers SGLang's endpoints the way SGLang 0.5.9 does, and
appends every request it gets to the JSON-lines file ``$FAKE_SGLANG_RECORD`` (one record per request,
plus one ``launch`` record with its argv, ``CUDA_VISIBLE_DEVICES``, ``NCCL_CUMEM_ENABLE`` and ``SGLANG_PLUGINS``).
``--attention-backend rlperf`` (the backend rlperf's SGLang plugin registers) and ``--page-size`` are accepted
and recorded with the argv; nothing here computes rlperf's numerics. Every ``/generate`` body is recorded, its
``sampling_params.sampling_seed`` with it.

* ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``): ``max_new_tokens`` tokens
  ``(sum(input_ids) + 7 * i) % vocab_size``, each with log-prob ``FAKE_LOGPROB``; reply ``output_ids``,
  ``meta_info.output_token_logprobs`` as ``[logprob, token_id, null]`` triples, ``finish_reason``.
* ``/init_weights_update_group`` joins the gloo group as ``rank_offset``;
  ``/update_weights_from_distributed`` (``load_format: "flattened_bucket"``) receives one broadcast of the
  tensors back to back and records each tensor's sha256; ``/update_weights_from_tensor`` records the body's
  fields and the globals its pickle references (never unpickled).
* ``$FAKE_SGLANG_FAIL``: ``import`` -- fail at import as a missing dependency does; ``hang`` -- never listen.
"""
import argparse
import hashlib
import json
import os
import pickletools
import sys
import threading
import time
from base64 import b64decode
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAKE_LOGPROB = -1.25

if os.environ.get("FAKE_SGLANG_FAIL") == "import":
    raise ModuleNotFoundError("No module named 'sgl_kernel'")

LOCK = threading.Lock()
STATE = {"groups": {}}


def record(kind, **fields):
    with LOCK, open(os.environ["FAKE_SGLANG_RECORD"], "a") as f:
        f.write(json.dumps({"kind": kind, "port": ARGS.port, **fields}) + "\n")


def parse(argv):
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    # rlperf: the backend rlperf's SGLang plugin registers (--sglang-numerics rlperf), with its --page-size
    p.add_argument("--attention-backend", choices=["flashinfer", "triton", "torch_native", "fa3", "rlperf"])
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--random-seed", type=int)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy", "safetensors"])
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--enable-return-routed-experts", action="store_true")  # MoE models: meta_info routed_experts
    return p.parse_args(argv)


def vocab_size():
    with open(os.path.join(ARGS.model_path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def pickle_globals(data: bytes) -> list:
    out, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            out.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL":  # module and name were pushed as the two strings before it
            out.append(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return out


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/health":
            return self.reply(200, {})
        if path in ("/get_server_info", "/server_info"):
            return self.reply(200, {"model_path": ARGS.model_path, "tp_size": ARGS.tp_size, "internal_states": [{
                "memory_usage": {"weight": 0.25, "kvcache": 0.5, "token_capacity": 4096, "graph": 0.0}}]})
        if path in ("/get_model_info", "/model_info"):
            return self.reply(200, {"model_path": ARGS.model_path, "is_generation": True})
        record("GET", path=path)
        return self.reply(404, {"error": {"message": f"no route {path}"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        path = self.path
        if path == "/generate":
            record("generate", body=body)
            ids, sp = body["input_ids"], body["sampling_params"]
            out = [(sum(ids) + 7 * i) % vocab_size() for i in range(sp["max_new_tokens"])]
            return self.reply(200, {"output_ids": out, "meta_info": {
                "finish_reason": {"type": "length", "length": len(out)}, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "output_token_logprobs": [[FAKE_LOGPROB, t, None] for t in out]}})
        if path == "/init_weights_update_group":
            from rlperf.sync.distributed import init_weight_update_group

            record("init_weights_update_group", body=body)
            STATE["groups"][body["group_name"]] = init_weight_update_group(
                body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
                group_name=body["group_name"], backend=body["backend"])
            return self.reply(200, {"success": True, "message": "Succeeded to initialize custom process group."})
        if path == "/update_weights_from_distributed":
            import torch

            group = STATE["groups"][body["group_name"]]
            sizes = [torch.empty(0, dtype=getattr(torch, d)).element_size() * _numel(s)
                     for d, s in zip(body["dtypes"], body["shapes"])]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            group.wait(group.broadcast(buf), host=True)
            raw, digests, start = buf.numpy().tobytes(), [], 0
            for n in sizes:
                digests.append(hashlib.sha256(raw[start:start + n]).hexdigest())
                start += n
            record("update_weights_from_distributed", body=body, sha256=digests)
            return self.reply(200, {"success": True, "message": "Succeeded to update parameter online."})
        if path == "/update_weights_from_tensor":
            entries = body["serialized_named_tensors"]
            record("update_weights_from_tensor", fields=sorted(body), load_format=body.get("load_format"),
                   flush_cache=body.get("flush_cache"), weight_version=body.get("weight_version"),
                   entries=len(entries), same_entries=len(set(entries)) == 1,
                   globals=sorted(set(pickle_globals(b64decode(entries[0])))))
            return self.reply(200, {"success": True, "message": "Success"})
        if path == "/destroy_weights_update_group":
            record("destroy_weights_update_group", body=body)
            group = STATE["groups"].pop(body.get("group_name", "weight_update_group"), None)
            if group is not None:
                group.close()
            return self.reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})
        if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            record(path.strip("/"), body=body)
            return self.reply(200, {"message": "ok"})
        record("POST", path=path, body=body)
        return self.reply(404, {"error": {"message": f"no route {path}"}})


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    ARGS = parse(sys.argv[1:])
    record("launch", argv=sys.argv[1:], cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
           nccl_cumem_enable=os.environ.get("NCCL_CUMEM_ENABLE"), sglang_plugins=os.environ.get("SGLANG_PLUGINS"))
    if os.environ.get("FAKE_SGLANG_FAIL") == "hang":
        while True:
            time.sleep(1)
    # torch and the group helper load while /health already answers (a real engine has them loaded)
    threading.Thread(target=lambda: __import__("rlperf.sync.distributed"), daemon=True).start()
    ThreadingHTTPServer((ARGS.host, ARGS.port), Handler).serve_forever()
