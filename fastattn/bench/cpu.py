"""Which CPU a benchmark ran on: vendor, family, model and stepping (x86's
CPUID leaf 1, as Linux reports it in /proc/cpuinfo) or implementer and part
(aarch64's MIDR), the microarchitecture they name, and the cache sizes.

A virtual machine often hides the marketing name ("AMD EPYC"), but not the
CPUID numbers: family 25, model 17 is Zen 4 (Genoa) whatever the name says.
The table below is small on purpose: the cores this project is measured on
and their neighbours; an unknown core is named None, its numbers kept.
"""
import os
import re

# (vendor, family): [(first model, last model, name)], from AMD's and Intel's
# processor programming references (models in hex as they publish them)
X86 = {
    ("AuthenticAMD", 0x17): [(0x00, 0x2F, "Zen / Zen+"), (0x30, 0xAF, "Zen 2")],
    ("AuthenticAMD", 0x19): [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"),
                             (0x20, 0x5F, "Zen 3"), (0x60, 0x7F, "Zen 4"),
                             (0xA0, 0xAF, "Zen 4")],
    ("AuthenticAMD", 0x1A): [(0x00, 0xFF, "Zen 5")],
    ("GenuineIntel", 6): [(0x3C, 0x3C, "Haswell"), (0x3F, 0x3F, "Haswell"),
                          (0x45, 0x46, "Haswell"), (0x4F, 0x4F, "Broadwell"),
                          (0x56, 0x56, "Broadwell"), (0x4E, 0x4E, "Skylake"),
                          (0x5E, 0x5E, "Skylake"), (0x55, 0x55, "Skylake-SP / Cascade Lake"),
                          (0x6A, 0x6A, "Ice Lake-SP"), (0x6C, 0x6C, "Ice Lake-SP"),
                          (0x7D, 0x7E, "Ice Lake"), (0x8C, 0x8D, "Tiger Lake"),
                          (0x8E, 0x8E, "Kaby / Coffee Lake"), (0x9E, 0x9E, "Kaby / Coffee Lake"),
                          (0x8F, 0x8F, "Sapphire Rapids"), (0xCF, 0xCF, "Emerald Rapids"),
                          (0xAD, 0xAE, "Granite Rapids"), (0xAF, 0xAF, "Sierra Forest"),
                          (0x97, 0x9A, "Alder Lake"), (0xB7, 0xB7, "Raptor Lake"),
                          (0xBA, 0xBA, "Raptor Lake"), (0xBF, 0xBF, "Raptor Lake"),
                          (0xAA, 0xAC, "Meteor Lake"), (0xC5, 0xC6, "Arrow Lake"),
                          (0xBD, 0xBD, "Lunar Lake")],
}
# aarch64: (implementer, part) -> name, from Arm's and the vendors' MIDR lists
ARM = {(0x41, 0xD03): "Cortex-A53", (0x41, 0xD08): "Cortex-A72", (0x41, 0xD0B): "Cortex-A76",
       (0x41, 0xD0C): "Neoverse N1", (0x41, 0xD40): "Neoverse V1", (0x41, 0xD49): "Neoverse N2",
       (0x41, 0xD4F): "Neoverse V2", (0x41, 0xD8E): "Neoverse N3", (0x41, 0xD84): "Neoverse V3",
       (0xC0, 0xAC3): "AmpereOne", (0x61, 0x022): "Apple M1", (0x61, 0x032): "Apple M2"}


def name(vendor, family, model):
    """The microarchitecture of an x86 CPUID triple, or None."""
    for first, last, arch in X86.get((vendor, family), []):
        if first <= model <= last:
            return arch
    return None


def _fields(text):
    """The first processor's "key : value" lines of /proc/cpuinfo."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _int(text):
    try:
        return int(text, 0)
    except (TypeError, ValueError):
        return None


def caches(root="/sys/devices/system/cpu/cpu0/cache"):
    """{"L1d": bytes, "L1i": ..., "L2": ..., "L3": ...} of the first core."""
    sizes = {}
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, index, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(root, index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, index, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if not m:
            continue
        label = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        sizes[label] = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    return sizes


def describe(cpuinfo="/proc/cpuinfo"):
    """The CPU of this machine: a dict with name (the microarchitecture, or
    None), vendor and family / model / stepping (x86) or implementer / part
    / variant / revision (aarch64), model_name as the OS gives it, and the
    cache sizes in bytes."""
    try:
        with open(cpuinfo) as f:
            fields = _fields(f.read())
    except OSError:
        fields = {}
    out = {"model_name": fields.get("model name"), "caches": caches()}
    if "vendor_id" in fields:
        vendor, family = fields["vendor_id"], _int(fields.get("cpu family"))
        model = _int(fields.get("model"))
        out.update(vendor=vendor, family=family, model=model,
                   stepping=_int(fields.get("stepping")), name=name(vendor, family, model))
    elif "CPU implementer" in fields:
        implementer, part = _int(fields["CPU implementer"]), _int(fields.get("CPU part"))
        out.update(implementer=implementer, part=part, variant=_int(fields.get("CPU variant")),
                   revision=_int(fields.get("CPU revision")), name=ARM.get((implementer, part)))
    else:
        out["name"] = None
    return out


def label(cpu):
    """A short label: "Zen 4 (AuthenticAMD family 25 model 17)"."""
    if cpu.get("vendor"):
        ident = f"{cpu['vendor']} family {cpu['family']} model {cpu['model']}"
    elif cpu.get("implementer") is not None:
        ident = f"implementer {cpu['implementer']:#x} part {cpu['part']:#x}"
    else:
        ident = cpu.get("model_name") or "unknown CPU"
    return f"{cpu['name']} ({ident})" if cpu.get("name") else ident


def machine_label(machine):
    """The CPU of a record's machine dict, named: its cpu_id when the record
    has one (records before it have only the OS's model name)."""
    cpu = machine.get("cpu_id")
    if not cpu:
        return machine.get("cpu", "unknown CPU")
    sizes = ", ".join(f"{k} {v >> 20} MiB" if v >= 1 << 20 else f"{k} {v >> 10} KiB"
                      for k, v in cpu.get("caches", {}).items() if k in ("L2", "L3"))
    shown = cpu.get("model_name")
    return (label(cpu) + (f", stepping {cpu['stepping']}" if cpu.get("stepping") is not None
                          else "") + (f"; {sizes}" if sizes else "")
            + (f"; the OS names it {shown!r}" if shown else ""))
