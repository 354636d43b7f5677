"""BitFit (Ben Zaken et al., ACL 2022): train only bias terms.

Paper defaults: every bias of the encoder (attention q/k/v/o, FFN in/out, LayerNorm β), learning rate
around 1e-3. Here each bias delta is the job's own zero-initialised tensor added to the frozen bias,
so the shared backbone is never written (and a model without biases, such as Llama, gains them).
"""

from pelt_core.spec import MethodSpec

BITFIT = MethodSpec(
    name="bitfit",
    modules={},
    bias=True,
    description="bias terms only",
    reference="Ben Zaken, Ravfogel, Goldberg. BitFit. ACL 2022",
    defaults={"learning_rate": 1e-3},
)

PRESETS = [BITFIT]
