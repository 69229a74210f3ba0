"""Which keras-hub models `scalify` converts, and how much of them.

For each tiny keras-hub model of `tests/hub_models.py` (random weights,
nothing downloaded) this prints, under `scaled_fp8`: the layers converted
(by class), the share of the kernel GEMM FLOPs of one forward call that run
in scaled layers and on an FP8 route (`keras_scalify.debug.gemm_coverage`),
how far scales propagate inside the blocks (`keras_scalify.debug.
propagation`: of the calls of converted layers, how many received a
ScaledTensor handed on by the layer or op before them rather than a plain
tensor to encode; `keras.ops` calls on ScaledTensors run by a scale rule
or decoded), whether the represented parameter count is unchanged, and for
comparison
the share Keras's own `model.quantize("float8")` reaches (Dense and
EinsumDense only).

    python benchmarks/hub_coverage.py [--models llama gemma ...]
"""

import argparse
import collections
import os
import platform
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify.layers.own_weights import has_own_weights  # noqa: E402
from tests import hub_models as hm  # noqa: E402


def keras_float8_fraction(name):
    """Share of GEMM FLOPs in layers Keras's `quantize("float8")` converts."""
    model = hm.MODELS[name]()
    x = hm.make_inputs(name)
    # FLOPs per layer from the float model (quantized layers run
    # `quantized_call`, which the counter does not see), then which layers
    # `quantize` reached.
    coverage = ksc.debug.gemm_coverage(model, x)
    model.quantize("float8")
    by_path = {
        layer.path: layer for layer in model._flatten_layers(recursive=True)
    }
    fp8 = sum(
        flops
        for path, _, flops, _, _ in coverage["layers"]
        if getattr(by_path.get(path), "quantization_mode", None) == "float8"
    )
    return fp8 / coverage["total"]


def row(name):
    model = hm.MODELS[name]()
    x = hm.make_inputs(name)
    n_params = model.count_params()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ksc.scalify(model, dtype="scaled_fp8")
    kept = [str(w.message) for w in caught if "kept as a plain" in str(w.message)]
    coverage = ksc.debug.gemm_coverage(model, x)
    layers = model._flatten_layers(recursive=True)
    converted = collections.Counter(
        getattr(type(layer), "_scaled_class_name", type(layer).__name__)
        for layer in layers
        if isinstance(layer, ksc.layers.ScaledLayer)
    )
    # Custom layers whose own kernels were scaled (mixture-of-experts banks).
    converted.update(
        f"{type(layer).__name__} (own kernels)"
        for layer in layers
        if has_own_weights(layer)
    )
    plain_gemms = sorted({r[1] for r in coverage["layers"] if not r[3]})
    prop = ksc.debug.propagation(model, x)
    calls = prop["scaled_inputs"] + prop["plain_inputs"]
    try:
        keras_fp8 = f"{keras_float8_fraction(name):.1%}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        keras_fp8 = f"fails ({type(e).__name__})"
    return {
        "model": f"{name} ({type(model).__name__})",
        "converted": ", ".join(
            f"{n}×{c.replace('Scaled', '')}" for c, n in sorted(converted.items())
        ),
        "scaled": f"{coverage['fraction']:.1%}",
        "fp8": f"{coverage['fp8'] / coverage['total']:.1%}",
        "handed_on": f"{prop['scaled_inputs']}/{calls}",
        "ops": f"{sum(prop['rule'].values())} / {sum(prop['fallback'].values())}",
        "params": "same" if ksc.debug.count_params(model) == n_params else "CHANGED",
        "plain": ", ".join(plain_gemms) or "–",
        "keras": keras_fp8,
        "kept": kept,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(hm.MODELS))
    args = parser.parse_args(argv)
    print(f"backend: {keras.backend.backend()}; keras {keras.__version__}; "
          f"keras-hub {__import__('keras_hub').__version__}; "
          f"python {platform.python_version()}")
    print()
    print(
        "| model | converted layers | GEMM FLOPs in scaled layers | in FP8 "
        "| inputs handed on scaled | ops by rule / decoded | params "
        "| GEMMs left plain | Keras `quantize(\"float8\")` |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        r = row(name)
        rows.append(r)
        print(
            f"| {r['model']} | {r['converted']} | {r['scaled']} | {r['fp8']} "
            f"| {r['handed_on']} | {r['ops']} "
            f"| {r['params']} | {r['plain']} | {r['keras']} |",
            flush=True,
        )
    for r in rows:
        for message in r["kept"]:
            print(f"- {r['model']}: {message}")
    return rows


if __name__ == "__main__":
    main()
