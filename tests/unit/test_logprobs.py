import torch
from torch.testing import assert_close

from learner.logprobs import logprobs_and_entropy, naive_logprobs_and_entropy


def test_chunked_equals_naive_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=g)
    lp, ent = logprobs_and_entropy(head, hidden, targets, temperature=0.7, chunk=8)  # 5 chunks, last one short
    lp0, ent0 = naive_logprobs_and_entropy(head, hidden, targets, temperature=0.7)
    assert_close(lp, lp0)
    assert_close(ent, ent0)
    (lp.sum() + 0.3 * ent.sum()).backward()
    g_chunked, w_chunked = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    (lp0.sum() + 0.3 * ent0.sum()).backward()
    assert_close(g_chunked, hidden.grad)
    assert_close(w_chunked, head.weight.grad)


def test_no_grad_path_and_empty_input():
    head = torch.nn.Linear(4, 10)
    with torch.no_grad():
        lp, ent = logprobs_and_entropy(head, torch.randn(5, 4), torch.zeros(5, dtype=torch.long), chunk=2)
    assert lp.shape == ent.shape == (5,) and (lp <= 0).all() and (ent >= 0).all()
    lp, ent = logprobs_and_entropy(head, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert lp.numel() == 0 and ent.numel() == 0
