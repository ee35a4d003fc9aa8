"""The paper-scale prompt template (a guess: the paper's is not known; ``data`` says why this one)."""

TEMPLATE = "{problem}\n\nLet's think step by step and output the final answer within \\boxed{{}}."
