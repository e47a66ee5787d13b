from mscclang import *

n = 4  # one-shot LL allreduce: every rank packs its input into each peer's scratch, then sums in rank order
with CollectiveProgram("oneshot", AllReduce(n, 1, False), n, protocol="LL", use_double_scratch_buffer=True):
    scratch = [Buffer(r, (n - 1) * n) for r in range(n)]
    slot = lambda src, dst: (src if src < dst else src - 1) * n  # where src's packets land on dst
    for r in range(n):
        inp, out = Rank(r).get_input_buffer(), Rank(r).get_output_buffer()
        for p in [p for p in range(n) if p != r]:
            MemoryChannel(p, r).put_packets(scratch[p][slot(r, p):slot(r, p) + n], inp[0:n], tb=0)
        for k in range(n):
            got = [scratch[r][slot(p, r) + k:slot(p, r) + k + 1] for p in range(n) if p != r]
            Rank(r).reduce(inp[k:k + 1], got, tb=0, dst_chunk=out[k:k + 1], packet=True, src_position=r)
    print(JSON())
