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


def inclusive(path, wanted):
    """Instructions spent inside each function named in `wanted` (itself and what it
    calls), summed over the calls other functions make to it: the cost line after a
    `calls=` line is that call's inclusive cost (callgrind's format)."""
    names, spent = {}, collections.Counter()
    fn = cfn = None
    after_call = False
    for line in open(path, errors="replace"):
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.strip())
            if m.group(2):
                names[m.group(1)] = m.group(2)
            name = names.get(m.group(1), m.group(1))
            if line.startswith("fn="):
                fn = name
            else:
                cfn = name
        elif line.startswith("calls="):
            after_call = True
        elif after_call and line[:1] and (line[0].isdigit() or line[0] in "+-*"):
            parts = line.split()
            if cfn in wanted and cfn != fn and len(parts) > 1:
                spent[cfn] += int(parts[1])
            after_call = False
    return spent
