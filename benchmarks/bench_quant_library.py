"""Does qwix fit jmsnas's pure-function networks? Evaluating many bit assignments: qwix vs jmsnas.quant.

qwix.quantize_model rewrites flax modules (nnx/linen); jmsnas networks are functions over dicts, so only the
array-level qwix.quantize applies. Its qtype is a static string, so every distinct bit assignment is a new program.
Run: python benchmarks/bench_quant_library.py  (needs the bench extra: pip install -e ".[bench]")
"""
import time, os
import jax, jax.numpy as jnp, numpy as np
import qwix
from jmsnas.quant.quantizers import fake_quant_weight

rng = np.random.default_rng(0)
ws = [jnp.asarray(rng.normal(size=(64, 96)), jnp.float32) for _ in range(27)]
assign = [tuple(int(b) for b in rng.choice([2, 4, 6, 8], size=27)) for _ in range(6)]

def q_qwix(bits):
    @jax.jit
    def f(ws):
        return sum(jnp.sum(qwix.dequantize(qwix.quantize(w, f"int{b}", channelwise_axes=[1]))) for w, b in zip(ws, bits))
    return f

@jax.jit
def q_own(ws, bits):
    return sum(jnp.sum(fake_quant_weight(w, bits[i])) for i, w in enumerate(ws))

def times(call):
    out = []
    for a in assign:
        t = time.time(); call(a); out.append(time.time() - t)
    return out
tq = times(lambda a: q_qwix(a)(ws).block_until_ready())
to = times(lambda a: q_own(ws, jnp.asarray(a, jnp.int32)).block_until_ready())
print(f"per bit assignment (27 weights), first then median of the other 5: qwix {tq[0]:.2f} s / {np.median(tq[1:]):.3f} s;"
      f" traced-bits function {to[0]:.2f} s / {np.median(to[1:]):.4f} s; load {os.getloadavg()[0]:.1f}")
q = qwix.quantize(ws[0], "int5", channelwise_axes=[1]); q3 = qwix.quantize(ws[0], "int3", channelwise_axes=[1])
print("qwix storage dtype int5:", q.qvalue.dtype, " int3:", q3.qvalue.dtype)
try:
    qwix.quantize(ws[0], "int16")
except Exception as e:
    print("int16:", type(e).__name__, str(e)[:80])
