"""The benchmark records and what is drawn from them: every record names its
CPU, README's speed table is benchmarks/render_readme.py's output, and the
CPU naming reads CPUID's numbers as the vendors publish them."""
import json
from pathlib import Path

import pytest
from conftest import load_script

from fastattn.bench import cpu

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "records"


def renderer():
    if not (ROOT / "README.md").exists():
        pytest.skip("README.md is not beside tests/")
    return load_script("benchmarks/render_readme.py")


def test_readme_speed_table_is_rendered_from_the_records():
    render = renderer()
    readme = (ROOT / "README.md").read_text()
    table = render.render()
    assert table in readme, "README's table is stale: python benchmarks/render_readme.py --write"
    assert render.replace(readme, table) == readme
    rows = {}  # a row per shape of each record, named by its CPU
    for name in render.RECORDS:
        record = json.loads((RECORDS / name).read_text())
        cell = f"| {render.cpu_cell(record['machine'])} |"
        rows[cell] = rows.get(cell, 0) + len(record["settings"]["shapes"])
    for cell, n in rows.items():
        assert table.count(cell) == n, cell


def test_every_record_names_its_cpu_and_is_listed():
    renderer()
    listed = (RECORDS / "README.md").read_text()
    for path in sorted(RECORDS.glob("*.json")):
        machine = json.loads(path.read_text())["machine"]
        assert machine["cpu_id"]["name"], path.name
        assert f"`{path.name}`" in listed, f"{path.name} is not in benchmarks/records/README.md"


@pytest.mark.parametrize("vendor,family,model,name", [
    ("AuthenticAMD", 25, 17, "Zen 4"),      # Genoa, the records' VM
    ("AuthenticAMD", 25, 1, "Zen 3"),       # Milan
    ("AuthenticAMD", 25, 0x61, "Zen 4"),    # Raphael
    ("AuthenticAMD", 26, 2, "Zen 5"),       # Turin
    ("GenuineIntel", 6, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0x55, "Skylake-SP / Cascade Lake"),
    ("GenuineIntel", 6, 0x01, None),        # not in the table: named None, numbers kept
    ("HygonGenuine", 24, 1, None),
])
def test_microarchitecture_names(vendor, family, model, name):
    assert cpu.name(vendor, family, model) == name


def test_describe_reads_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                   "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel\t\t: 99\n")
    d = cpu.describe(str(x86))
    assert (d["vendor"], d["family"], d["model"], d["stepping"], d["name"]) == (
        "AuthenticAMD", 25, 17, 1, "Zen 4")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
                   "CPU variant\t: 0x1\nCPU part\t: 0xd0c\nCPU revision\t: 1\n")
    d = cpu.describe(str(arm))
    assert (d["implementer"], d["part"], d["name"]) == (0x41, 0xD0C, "Neoverse N1")
    assert cpu.describe(str(tmp_path / "missing"))["name"] is None
    assert "Zen 4 (AuthenticAMD family 25 model 17)" in cpu.machine_label(
        {"cpu": "AMD EPYC", "cpu_id": cpu.describe(str(x86))})
    assert cpu.machine_label({"cpu": "AMD EPYC"}) == "AMD EPYC"  # a record from before cpu_id
