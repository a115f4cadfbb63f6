import json, os, sys, time
import jax, jax.numpy as jnp
import jax_flash
from jax_flash.bench import decode, prefill, timing
from jax_flash.bench.shapes import DecodeShape, PrefillShape

out = os.environ.get("OUT", "/tmp")
what = sys.argv[1:] or ["decode", "sweep", "heads", "prefill"]
B = lambda b, c, d=128, cd="bfloat16": DecodeShape(b, c, 32, 8, d, 16, "bfloat16", cd)
if "decode" in what:
    shapes = [B(1, 4096), B(1, 8192), B(1, 32768), B(2, 8192), B(4, 8192), B(8, 8192), B(8, 32768),
              B(32, 4096), B(64, 8192), B(128, 2048), B(256, 1024),
              B(64, 8192, cd="int8"), B(64, 8192, cd="float8_e4m3fn")]
    decode.run_decode("quick", ("bfloat16",), out, shapes=shapes, skip=("jnp_gather", "pallas_k"))
if "heads" in what:
    shapes = [B(b, c, d) for b, c in ((64, 8192), (1, 32768)) for d in (128, 80, 96, 112, 160, 64, 256)]
    decode.run_decode("quick", ("bfloat16",), out, shapes=shapes,
                      skip=("jnp_gather", "pallas", "cudnn", "fa3"))
if "sweep" in what:
    res = {}
    for b, c in ((1, 4096), (1, 8192), (1, 32768), (2, 8192), (4, 8192), (8, 8192)):
        s = B(b, c)
        data = decode.make_paged(s, jax.random.key(1))
        q, kp, vp, bt, kl, _, _ = data
        for ns in (4, 8, 16, 32, 48, 64, 128):
            fn = lambda q, kp, vp, bt, kl, ns=ns: jax_flash.paged_attention(q, kp, vp, bt, kl, num_splits=ns)
            try:
                t, _ = timing.loop_time(fn, (q, kp, vp, bt, kl), n=400, chain=(0, 3))
                res[f"{b}x{c} s{ns}"] = (round(t * 1e6, 2), round(s.kv_bytes / t / 1e9))
            except Exception as e:
                res[f"{b}x{c} s{ns}"] = str(e)[:100]
            print(f"{b}x{c} s{ns}", res[f"{b}x{c} s{ns}"], flush=True)
    json.dump(res, open(f"{out}/sweep.json", "w"), indent=1)
if "prefill" in what:
    shapes = [PrefillShape(4, 4096, 32, 8, d, c, "bfloat16") for c in (False, True)
              for d in (128, 64, 80, 96, 112, 160, 192, 256)]
    prefill.run_prefill("quick", ("bfloat16",), out, shapes=shapes,
                        skip=("cudnn", "pallas", "xla_dpa", "jnp_reference", "fa3", "tokamax"))
