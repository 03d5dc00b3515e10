"""answer_format.py: the number a text's answer states, as MATH (the last \\boxed{...}) and GSM8K
('#### N') write it, else its last number; fractions too. Read by common.math_reward and
common.format_reward, the held-out metric (common.eval_metric) and --data checks (tasks.py)."""
import re


def last_boxed(text):
    """The content of the text's last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_number(text):
    """The number a text ends on: inside its last \\boxed{} if it has one (MATH-style), else
    after '####' (GSM8K-style), else its last number. Reads 1,234, -2.5, 3/4 and \\frac{3}{4}."""
    boxed = last_boxed(text)
    text = (boxed if boxed is not None else text.split("####")[-1]).replace(",", "")
    text = re.sub(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}", r"\1/\2", text)
    nums = re.findall(r"(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?", text)
    if not nums:
        return None
    num, den = nums[-1]
    return float(num) / float(den) if den and float(den) else float(num)
