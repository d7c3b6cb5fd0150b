// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * A load generator and a sink for benchmarks/kernel_plane.py, in the kernel.
 *
 * One user-space generator core (turn_load.c: sendmmsg through a UDP socket)
 * offers ~300k datagrams/s on this machine: less than the kernel plane
 * forwards, so that benchmark could only say "at least the generator's
 * rate". These programs take the socket layer out of the generator:
 *
 * load_gen   run by BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (Linux
 *            >= 5.18), which builds real frames from one template and
 *            transmits what returns XDP_TX out of the device named as the
 *            context's ingress (a veth: straight into its peer's receive
 *            queue). Each run writes the frame of the next of `flows`
 *            flows (whole frames with correct checksums from the `flows`
 *            map, so every flow is a distinct route) and paces itself: a
 *            frame goes out only when its slot on a `interval_ns` grid has
 *            come, else it is dropped in place (the run costs a few tens of
 *            ns). The grid restarts when the generator was off the CPU for
 *            more than a slot's slack, so a stall never turns into a burst
 *            that a receive ring could not hold.
 * load_sink  on the client's and the peer's devices: while `sinking` is on,
 *            counts and drops IPv4 UDP (the count is the benchmark's
 *            "delivered"), else passes everything. Its veth then receives
 *            through NAPI (a veth without an XDP program or GRO does not
 *            take XDP frames redirected to it).
 * load_pass  on a relay's ingress device when the relay itself attaches no
 *            XDP program: gives that veth NAPI (so it can receive the
 *            generator's frames) and passes every frame to the stack.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define MAX_FLOWS 1024
/* A generator that fell this far behind its grid starts a new one. */
#define SLACK_NS 20000

/* A flow's whole frame. The generator writes all of it into every frame it
 * sends: live frames are recycled from a page pool *as the last receiver
 * left them*, and a relay or router on the way rewrites headers in place
 * (MAC addresses, TTL, ports, ChannelData), so a frame that came back would
 * otherwise go out again with another hop's addresses. */
#define FRAME_MAX 1536
struct flow {
	__u8 frame[FRAME_MAX];
};

struct gen_state {
	__u64 interval_ns; /* 0: as fast as the device takes them */
	__u64 next_ns;
	__u64 sent;
	__u64 restarts; /* grids restarted after a stall */
	__u32 flows;
	__u32 next_flow;
	__u32 frame_len; /* every flow's, and the template's */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_state);
} gen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_FLOWS);
	__type(key, __u32);
	__type(value, struct flow);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sunk SEC(".maps");

/* [0] != 0: the sinks drop (and count) IPv4 UDP; 0: they pass everything,
 * so sockets behind them work (the ping-pong, a TURN allocation). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} sinking SEC(".maps");

SEC("xdp")
int load_gen(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct gen_state *st = bpf_map_lookup_elem(&gen, &zero);
	if (!st)
		return XDP_DROP;
	if (st->interval_ns) {
		__u64 now = bpf_ktime_get_ns();
		if (now < st->next_ns)
			return XDP_DROP;
		if (now - st->next_ns > SLACK_NS) {
			st->next_ns = now;
			st->restarts++;
		}
		st->next_ns += st->interval_ns;
	}
	__u32 index = st->next_flow;
	st->next_flow = index + 1 >= st->flows ? 0 : index + 1;
	struct flow *f = bpf_map_lookup_elem(&flows, &index);
	if (!f)
		return XDP_DROP;
	__u32 len = st->frame_len;
	if (len == 0 || len > FRAME_MAX)
		return XDP_DROP;
	if (bpf_xdp_store_bytes(ctx, 0, f->frame, len))
		return XDP_DROP;
	st->sent++;
	return XDP_TX;
}

SEC("xdp")
int load_sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u8 *frame = data;
	/* IPv4 UDP only: ARP and the rest go to the stack, so the relay can
	 * still resolve this side's link-layer address. */
	if ((void *)(frame + 24) > end || frame[12] != 0x08 || frame[13] != 0x00 ||
	    frame[23] != 17)
		return XDP_PASS;
	__u32 zero = 0;
	__u32 *on = bpf_map_lookup_elem(&sinking, &zero);
	if (!on || !*on)
		return XDP_PASS;
	__u64 *count = bpf_map_lookup_elem(&sunk, &zero);
	if (count)
		*count += 1;
	return XDP_DROP;
}

SEC("xdp")
int load_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
