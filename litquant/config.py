"""`QuantizeConfig`: the settings of a quantized checkpoint, and `quantize_config.json` in and out.

The JSON uses the field names of AutoGPTQ/GPTQModel (GPTQ) and AutoAWQ/HF (AWQ), so those tools read
our checkpoints' settings. What only litquant needs (the recipe that produced the checkpoint, the
default kernel, the modules left unquantized) lives under the key "litquant", which they ignore.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Literal, Optional

from litquant.formats import QuantizedWeight, awq, gptq
from litquant.formats.common import num_groups

CONFIG_NAME = "quantize_config.json"
METHODS = ("rtn", "gptq", "awq")
FORMATS = ("gptq", "gptq_v2", "awq_gemm", "awq_gemv")
GPTQ_FIELDS = {"bits", "group_size", "damp_percent", "desc_act", "static_groups", "sym", "true_sequential",
               "quant_method", "checkpoint_format", "model_name_or_path", "model_file_base_name", "is_marlin_format",
               "lm_head", "meta", "pack_dtype", "dynamic", "v2", "mse", "hyb_act", "format", "damp_auto_increment"}
AWQ_FIELDS = {"quant_method", "bits", "group_size", "zero_point", "version", "w_bit", "q_group_size",
              "modules_to_not_convert"}


@dataclass
class QuantizeConfig:
    """How a checkpoint was quantized and how it is stored."""

    method: Literal["rtn", "gptq", "awq"] = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    damp_percent: float = 0.01
    checkpoint_format: Literal["gptq", "gptq_v2", "awq_gemm", "awq_gemv"] = "gptq"
    kernel: str = "auto"
    ignore_modules: List[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        # Types first (a hand-edited quantize_config.json may hold "128"; the rules below compare numbers).
        wrong_types = [f"{name} must be an integer, not {getattr(self, name)!r}"
                       for name in ("bits", "group_size") if not _is_int(getattr(self, name))]
        wrong_types += [f"{name} must be true or false, not {getattr(self, name)!r}"
                        for name in ("sym", "desc_act", "static_groups", "true_sequential")
                        if not isinstance(getattr(self, name), bool)]
        if not (_is_int(self.damp_percent) or isinstance(self.damp_percent, float)):
            wrong_types.append(f"damp_percent must be a number, not {self.damp_percent!r}")
        if wrong_types:
            raise ValueError("invalid quantize config: " + "; ".join(wrong_types))
        problems = []
        if self.method not in METHODS:
            problems.append(f"method {self.method!r} is not one of {METHODS}")
        if self.bits not in (2, 3, 4, 8):
            problems.append(f"bits must be 2, 3, 4 or 8, not {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            problems.append(f"group_size must be -1 or positive, not {self.group_size}")
        if self.checkpoint_format not in FORMATS:
            problems.append(f"checkpoint_format {self.checkpoint_format!r} is not one of {FORMATS}")
        if self.is_awq:
            if self.bits != 4:
                problems.append("AWQ checkpoints are 4-bit only")
            if self.desc_act:
                problems.append("AWQ checkpoints cannot store act_order (desc_act=True)")
            if self.sym:
                problems.append("AWQ checkpoints store zero points: use sym=False")
            if self.group_size == -1:
                problems.append("AWQ checkpoints need a group_size")
        if self.method == "rtn" and self.desc_act:
            problems.append("RTN quantizes every weight on its own, in order: desc_act (act_order) needs GPTQ")
        if self.static_groups and not self.desc_act:
            problems.append("static_groups only matters with desc_act=True")
        if not 0 <= self.damp_percent < 1:
            problems.append(f"damp_percent must be in [0, 1), not {self.damp_percent}")
        if problems:
            raise ValueError("invalid quantize config: " + "; ".join(problems))

    @classmethod
    def for_method(cls, method: str, *, sym: Optional[bool] = None, checkpoint_format: str = "gptq",
                   version: str = "gemm", **fields) -> "QuantizeConfig":
        """The config `litquant quantize --method <method>` writes: symmetric unless AWQ (when `sym` is None), in the
        GPTQ `checkpoint_format`, or AutoAWQ's layout `version` for AWQ."""
        if method == "awq" and checkpoint_format != "gptq":
            raise ValueError(f"checkpoint_format {checkpoint_format!r} is a GPTQ format; AWQ's layout is its version "
                             "(gemm or gemv)")
        if method != "awq" and version != "gemm":
            raise ValueError(f"version {version!r} is an AWQ layout; {method} writes a GPTQ checkpoint_format")
        return cls(method=method, sym=method != "awq" if sym is None else sym,
                   checkpoint_format=f"awq_{version}" if method == "awq" else checkpoint_format, **fields)

    @property
    def is_awq(self) -> bool:
        return self.checkpoint_format.startswith("awq")

    # -- tensors of one Linear in this config's format --
    def pack(self, qw: QuantizedWeight) -> dict:
        if self.is_awq:
            return awq.pack(qw, self.checkpoint_format[4:])
        return gptq.pack(qw, self.checkpoint_format)

    def unpack(self, tensors: dict, in_features: int, out_features: int) -> QuantizedWeight:
        if self.is_awq:
            return awq.unpack(tensors, in_features, out_features, self.group_size, self.checkpoint_format[4:])
        return gptq.unpack(tensors, self.bits, self.group_size, self.checkpoint_format)

    def tensor_names(self) -> tuple:
        return awq.TENSOR_NAMES if self.is_awq else gptq.TENSOR_NAMES

    def check_shapes(self, tensors: dict, in_features: int, out_features: int, where: str = "") -> None:
        if self.is_awq:
            awq.check_layer(self.bits, in_features, out_features, self.group_size)
            awq.check_shapes(tensors, in_features, out_features, self.group_size, self.checkpoint_format[4:], where)
        else:
            gptq.check_shapes(tensors, self.bits, in_features, out_features, num_groups(in_features, self.group_size),
                              where)

    # -- quantize_config.json --
    def to_json_dict(self) -> dict:
        ours = {"method": self.method, "kernel": self.kernel, "ignore_modules": list(self.ignore_modules)}
        if self.is_awq:
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": self.checkpoint_format[4:], "litquant": ours}
        return {"bits": self.bits, "group_size": self.group_size, "damp_percent": self.damp_percent,
                "desc_act": self.desc_act, "static_groups": self.static_groups, "sym": self.sym,
                "true_sequential": self.true_sequential, "quant_method": "gptq",
                "checkpoint_format": self.checkpoint_format, "litquant": ours}

    @classmethod
    def from_json_dict(cls, d: dict) -> "QuantizeConfig":
        d = dict(d)
        ours = d.pop("litquant", {}) or {}
        unknown_ours = set(ours) - {"method", "kernel", "ignore_modules"}
        quant_method = d.get("quant_method", "gptq")
        if quant_method == "awq":
            unknown = set(d) - AWQ_FIELDS
            if unknown:
                raise ValueError(f"{CONFIG_NAME}: unknown AWQ fields {sorted(unknown)}")
            if d.get("zero_point", True) is not True:
                raise ValueError(f"{CONFIG_NAME}: AWQ without zero points (zero_point=false) is not supported")
            version = str(d.get("version", "gemm")).lower()
            if version not in awq.VERSIONS:
                raise ValueError(f"{CONFIG_NAME}: AWQ version {version!r} is not one of {awq.VERSIONS}")
            kwargs = dict(method=ours.get("method", "awq"), bits=d.get("bits", d.get("w_bit", 4)),
                          group_size=d.get("group_size", d.get("q_group_size", 128)), sym=False,
                          checkpoint_format=f"awq_{version}")
        elif quant_method == "gptq":
            unknown = set(d) - GPTQ_FIELDS
            if unknown:
                raise ValueError(f"{CONFIG_NAME}: unknown GPTQ fields {sorted(unknown)}")
            fmt = d.get("checkpoint_format", d.get("format", "gptq"))
            if fmt not in gptq.CHECKPOINT_FORMATS:
                raise ValueError(f"{CONFIG_NAME}: checkpoint_format {fmt!r} is not supported; expected one of "
                                 f"{gptq.CHECKPOINT_FORMATS}")
            kwargs = dict(method=ours.get("method", "gptq"), bits=d.get("bits", 4), group_size=d.get("group_size", 128),
                          sym=d.get("sym", True), desc_act=d.get("desc_act", False),
                          static_groups=d.get("static_groups", False), true_sequential=d.get("true_sequential", True),
                          damp_percent=d.get("damp_percent", 0.01), checkpoint_format=fmt)
        else:
            raise ValueError(f"{CONFIG_NAME}: quant_method {quant_method!r} is not supported (gptq or awq)")
        if unknown_ours:
            raise ValueError(f"{CONFIG_NAME}: unknown litquant fields {sorted(unknown_ours)}")
        if "kernel" in ours:
            kwargs["kernel"] = ours["kernel"]
        if "ignore_modules" in ours:
            kwargs["ignore_modules"] = list(ours["ignore_modules"])
        return cls(**kwargs)

    def save(self, directory: Path) -> None:
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "QuantizeConfig":
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {directory} is not a quantized checkpoint")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_json_dict(d)

    def describe(self) -> str:
        fmt = self.checkpoint_format
        order = " act_order" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit g{self.group_size} {'sym' if self.sym else 'zero-point'}{order} ({fmt})"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_quantized_checkpoint(directory: Path) -> bool:
    return (Path(directory) / CONFIG_NAME).is_file()
