"""Reads a callgrind profile: shared by the gateway-cost scripts (imported from here)."""
import collections
import re


def profile(path):
    """Total instructions, and calls into each function (by name)."""
    names, calls, total, cfn = {}, collections.Counter(), 0, None
    for line in open(path, errors="replace"):
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.strip())
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("cfn="):
                cfn = names.get(m.group(1), m.group(1))
        elif line.startswith("calls="):
            calls[cfn] += int(line[6:].split()[0])
        elif line.startswith(("totals:", "summary:")):
            total = int(line.split()[1])
    return total, calls
