"""answer_format.py: what a text's answer states, as MATH (\\boxed{...}) and GSM8K ('#### N') write
it; read by common.math_reward, common.has_numbers (the held-out metric) and --data checks."""
import re

NUMBER = r"(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?"  # 7, -2.5, 3/4: numerator, denominator


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


def final_answer(text, reference=False):
    """The last \\boxed{...}: a float if it holds a number alone (1,234, -2.5, \\frac{3}{4}), else
    a str, the expression without spaces, \\left, \\right (\\pi, (1,2)). No box: the number after
    '####', else the last number, or None. reference (a row's answer): read whole if no sentence."""
    if reference and not re.search(r"####|(?<![\\a-zA-Z])[a-zA-Z]{2,}", text):  # \\pi: no word
        text = f"\\boxed{{{text}}}"
    text = re.sub(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}", r"\1/\2", text)
    if (boxed := last_boxed(text)) is None:
        found = re.findall(NUMBER, text.split("####")[-1].replace(",", ""))
    else:  # a thousands comma goes (1,234), a list's stays (1,2)
        boxed = re.sub(r"(?<=\d),(?=\d{3}\b)|\s|\\left|\\right|\\?[$%]|\\[,!]|\.$", "", boxed)
        found = re.findall(NUMBER, boxed) if re.fullmatch(NUMBER, boxed) else []
    if not found:  # an expression if it is maths (a digit, or a command: \\pi), else None
        return boxed.replace("dfrac", "frac") if re.search(r"[\d\\]", boxed or "") else None
    num, den = found[-1]
    return float(num) / float(den) if den and float(den) else float(num)


def final_number(text):  # final_answer's number; None for an expression (\\pi, (1,2))
    return answer if isinstance(answer := final_answer(text), float) else None
