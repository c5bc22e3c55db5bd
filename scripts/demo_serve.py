"""The last step of `make demo`: start `mawforge serve` on a free port, ask one chat question
(argv[2], or one the demo model's corpus suits) with the official openai client, print the
answer and its telemetry, stop the server."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import openai


def main(pack: str, question: str = "What does Genesis 1:3 say?") -> int:
    cmd = [sys.executable, "-m", "mawforge.cli", "serve", "--pack", pack, "--model-id", "demo", "--port", "0",
           "--context", "512", "--expert-cache-percent", "25", "--max-tokens-default", "48", "--threads", "2"]
    srv = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in srv.stderr:
            sys.stderr.write(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            return srv.wait() or 1
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        r = client.chat.completions.create(model="demo", temperature=0, max_tokens=48,
                                           messages=[{"role": "user", "content": question}])
        print("served answer:", repr(r.choices[0].message.content))
        print("usage:", r.usage.model_dump())
        t = r.model_extra["telemetry"]
        print("telemetry:", json.dumps({k: t[k] for k in ("ttft_s", "decode_tok_s", "hits", "misses", "hit_rate",
                                                         "materialized_bytes", "expert_cache_bytes",
                                                         "kv_cache_bytes", "peak_rss_bytes", "pack_digest")}))
        return 0
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
