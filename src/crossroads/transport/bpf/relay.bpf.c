// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * crossroads kernel data plane: relayed UDP forwarded on tc ingress (and XDP).
 *
 * Theory of operation
 * -------------------
 * The route table in user space (crossroads.transport.kernelplane) writes one
 * entry of the `routes` hash map per proven flow. A UDP datagram arriving on
 * a device this program is attached to is looked up by
 *   (family, destination address and port, source address and port, channel)
 * where `channel` is the ChannelData channel number when the payload starts
 * like ChannelData (RFC 8656 §12.4: first two bits 01) and a route for it
 * exists, else 0. With a route, the datagram is rewritten and sent out of the
 * route's device with bpf_redirect_neigh (the kernel resolves the next hop's
 * link-layer address, as for a packet the host sends); without one it goes
 * on down the chain (PASS below: other processes' programs, then the
 * stack), unmodified, and so to the sockets (STUN/TURN control, Send/Data
 * indications, first packets, unknown routes: everything the control plane
 * must see).
 *
 * Actions (route_val.kind):
 *   UNWRAP_CHANNEL  TURN client -> peer: the 4-byte ChannelData header comes
 *                   off (its length field must equal the data's length: a
 *                   padded or short datagram goes to the stack, which has the
 *                   full check of RFC 8656 §12.5);
 *   WRAP_CHANNEL    TURN peer -> client: a 4-byte ChannelData header for the
 *                   bound channel goes on (no padding over UDP, §12.5);
 *   REWRITE         natneg relay pairs, RakNet UDPProxy: the datagram as is;
 *   RELAY           Unity RELAY frames, as is. A host's frames to each of
 *                   its joiners share one source and destination, so these
 *                   routes live in `relay_routes`, keyed also by the frame's
 *                   first 36 bytes (signature, version, type RELAY, from and
 *                   to allocation IDs), and are taken only when the frame's
 *                   DataLength (u16 at offset 36) is the rest of it: anything
 *                   else from that client (BIND, PING, DISCONNECT, CLOSE, a
 *                   frame to an unconnected ID) reaches the relay's socket.
 * Each rewrites the source to the relay's address and port on the far side
 * and the destination to the route's destination, sets the hop limit of a
 * new datagram (64, what the sockets send with) and fixes the IP and UDP
 * checksums incrementally (so a checksum the device will complete, on a
 * CHECKSUM_PARTIAL packet from a local or veth sender, stays correct too).
 * Each route counts packets and payload bytes (what the sockets' plane counts
 * as a route's packets and octets) for idle timeouts, quotas and metrics.
 *
 * Safety: nothing is forwarded without a live entry; removing the entry
 * stops the forwarding of the next packet. Only plain IPv4 (no options,
 * not fragmented) and IPv6 (UDP as the first next header) of one family on
 * both sides, non-GSO packets, are handled; anything else passes.
 * No loops: the program is straight-line apart from fixed-size copies.
 *
 * crossroads_relay_xdp (further down) does the same in XDP, in front of the
 * tc program, over the same maps and the same parse and lookup; what it
 * cannot finish it passes to tc untouched (docs/architecture.md "Which
 * hook, per device").
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <stddef.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#define KIND_UNWRAP_CHANNEL 1
#define KIND_WRAP_CHANNEL 2
#define KIND_REWRITE 3
#define KIND_RELAY 4

/* Unity RELAY: the bytes that name a route (header + from + to IDs), then
 * the u16 DataLength (crossroads.proto.relay.messages). */
#define RELAY_HEAD 36
#define RELAY_HEADER 38

/* Hop limit of a datagram the relay sends (Linux's default ip_default_ttl
 * and IPv6 hop_limit, what the socket planes send with). */
#define NEW_HOP_LIMIT 64
#define CHANNEL_HEADER 4

struct route_key {
	__u32 saddr[4]; /* IPv4: [0] only; saddr, daddr adjacent as in IPv6 */
	__u32 daddr[4];
	__u16 sport; /* network order */
	__u16 dport;
	__u16 channel; /* host order; 0 for routes keyed by address alone */
	__u8 family;   /* 4 or 6 */
	__u8 pad;
};

struct route_val {
	__u32 saddr[4]; /* the datagram's new source (the relay's far side) */
	__u32 daddr[4]; /* and destination */
	__u16 sport;    /* network order */
	__u16 dport;
	__u16 channel; /* WRAP_CHANNEL: the channel number, host order */
	__u8 kind;
	__u8 pad;
	__u32 ifindex; /* the device it leaves by */
	__u32 pad2;
	__u64 packets; /* counted here, read by user space */
	__u64 bytes;   /* payload bytes (without the ChannelData header) */
};

/* Bounded by the control plane's own caps (allocations x channels,
 * forwarders, relay pairs); user space refuses to install past it and the
 * route stays on the socket plane. Not preallocated: every process of a
 * host (--workers N, a test suite) loads its own maps, and a preallocated
 * pair costs ~25 MB of kernel memory and doubles the load time whether or
 * not it ever holds a route; only user space inserts (never the program),
 * so an insert that cannot allocate just leaves the route on the sockets. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct route_key);
	__type(value, struct route_val);
} routes SEC(".maps");

struct relay_key {
	struct route_key flow; /* channel 0 */
	__u8 head[RELAY_HEAD];
};

/* Unity RELAY routes (KIND_RELAY), bounded by the relay's allocations x
 * connections; the same value as `routes`, not preallocated either. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct relay_key);
	__type(value, struct route_val);
} relay_routes SEC(".maps");

/* Largest payload moved for a ChannelData header (a mask: 2047 bytes, more
 * than an Ethernet MTU's datagram); a larger one goes to the stack. */
#define MAX_MOVE 2047

/* Per-CPU room to move a datagram's data by the header's 4 bytes. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u8[MAX_MOVE + 1]);
} scratch SEC(".maps");

/* How the tc program moved a ChannelData datagram's data by the header's 4
 * bytes, per CPU: [TC_MOVED_HEADERS] the headers moved (a finished or absent
 * checksum), [TC_MOVED_DATA] the data copied out and back (a partial one). */
#define TC_MOVED_HEADERS 0
#define TC_MOVED_DATA 1
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} tc_moves SEC(".maps");

/* The lease of a program on a classic tc filter (Linux < 6.6): [0] is the
 * CLOCK_MONOTONIC deadline in ns its process keeps pushing forward, 0 when
 * every attachment is a tcx link (which dies with its process's descriptor).
 * A classic filter outlives a SIGKILLed process, and so do this program and
 * its maps (the filter holds them): past the deadline it passes everything,
 * so a dead process's stale routes forward nothing. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} lease SEC(".maps");

/* What the program does not route goes on down the chain: the next tcx
 * program or classic filter on the device (each crossroads process on the
 * host has its own, with its own routes), then the stack. TCX_NEXT and
 * TC_ACT_UNSPEC are both -1 (include/uapi/linux/bpf.h, pkt_cls.h); a
 * program that returned TC_ACT_OK (TCX_PASS) would end the chain and hide
 * the packet from every later process's program. */
#define PASS TC_ACT_UNSPEC

static __always_inline int
csum_l4(struct __sk_buff *skb, __u32 off, __u32 from, __u32 to, __u64 flags)
{
	return bpf_l4_csum_replace(skb, off, from, to, flags | BPF_F_MARK_MANGLED_0);
}

/* ------------------------------------------------ shared by both programs */

static __always_inline __u16 csum_fold(__u64 sum)
{
	sum = (sum & 0xFFFF) + (sum >> 16);
	sum = (sum & 0xFFFF) + (sum >> 16);
	sum = (sum & 0xFFFF) + (sum >> 16);
	return (__u16)sum;
}

/* Whether this process's routes may forward (the lease above). */
static __always_inline int lease_live(void)
{
	__u32 zero = 0;
	__u64 *deadline = bpf_map_lookup_elem(&lease, &zero);
	return deadline && !(*deadline && bpf_ktime_get_ns() > *deadline);
}

/* Whether a UDP checksum field holds only its pseudo-header's folded sum.
 * That is how a CHECKSUM_PARTIAL packet arrives (a local or veth sender left
 * the sum to the device): a change to it must go through the skb's checksum
 * state (tc's helpers) and the data must stay where csum_start says. Once in
 * 65536 datagrams a full checksum equals it too and takes that slower way. */
static __always_inline int
pseudo_sum_only(const struct route_key *key, __u16 ulen, __u16 check)
{
	__u32 pseudo[10] = {};
	__s64 sum;
	if (key->family == 4) {
		pseudo[0] = key->saddr[0];
		pseudo[1] = key->daddr[0];
		pseudo[2] = bpf_htonl(((__u32)IPPROTO_UDP << 16) | ulen);
		sum = bpf_csum_diff(NULL, 0, pseudo, 12, 0);
	} else {
		__builtin_memcpy(pseudo, key->saddr, 16);
		__builtin_memcpy(pseudo + 4, key->daddr, 16);
		pseudo[8] = bpf_htonl(ulen);
		pseudo[9] = bpf_htonl(IPPROTO_UDP);
		sum = bpf_csum_diff(NULL, 0, pseudo, 40, 0);
	}
	return sum >= 0 && check == csum_fold((__u64)sum);
}

/* Whether a datagram's UDP checksum is finished: a full sum, or none at all
 * (IPv4's 0; IPv6 has no such choice, and a 0 there is left to the stack). */
static __always_inline int
checksum_finished(const struct route_key *key, __u16 ulen, __u16 check)
{
	if (!check)
		return key->family == 4;
	return !pseudo_sum_only(key, ulen, check);
}

/* Parse Ethernet + plain IPv4 (no options, not fragmented) or IPv6 (UDP as
 * the first next header) + UDP whose length agrees with the IP header's:
 * fills the key's addresses and ports, the UDP header's offset and the UDP
 * length. Nonzero: not ours (the packet passes untouched). */
static __always_inline int
parse_udp(void *data, void *end, struct route_key *key, __u32 *l4, __u16 *ulen)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
		    (ip->frag_off & bpf_htons(0x3FFF)))
			return -1;
		key->family = 4;
		key->saddr[0] = ip->saddr;
		key->daddr[0] = ip->daddr;
		*l4 = sizeof(*eth) + sizeof(*ip);
		*ulen = bpf_ntohs(ip->tot_len) - sizeof(*ip);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_UDP)
			return -1;
		key->family = 6;
		__builtin_memcpy(key->saddr, &ip6->saddr, 16);
		__builtin_memcpy(key->daddr, &ip6->daddr, 16);
		*l4 = sizeof(*eth) + sizeof(*ip6);
		*ulen = bpf_ntohs(ip6->payload_len);
	} else {
		return -1;
	}
	struct udphdr *udp = data + *l4;
	if ((void *)(udp + 1) > end || bpf_ntohs(udp->len) != *ulen || *ulen < sizeof(*udp))
		return -1;
	key->sport = udp->source;
	key->dport = udp->dest;
	return 0;
}

/* The live route of a datagram whose UDP data starts at `p`, or NULL (it
 * passes): a ChannelData route (its length field must be the data's
 * length; `*chanword` gets the header), a Unity RELAY route (the frame's
 * first 36 bytes, its DataLength the rest), else an address route of the
 * other two kinds. */
static __always_inline struct route_val *
find_route(struct route_key *key, __u8 *p, void *end, __u16 ulen, __u32 *chanword)
{
	struct route_val *r = NULL;
	if ((void *)(p + CHANNEL_HEADER) <= end && (p[0] & 0xC0) == 0x40) {
		key->channel = ((__u16)p[0] << 8) | p[1];
		r = bpf_map_lookup_elem(&routes, key);
		if (r && r->kind != KIND_UNWRAP_CHANNEL)
			r = NULL;
		if (r) {
			__u16 length = ((__u16)p[2] << 8) | p[3];
			if (length != ulen - sizeof(struct udphdr) - CHANNEL_HEADER)
				return NULL;
			*chanword = *(__u32 *)p;
			return r;
		}
	}
	if ((void *)(p + RELAY_HEADER) <= end) {
		/* A Unity RELAY frame? Its route names its first 36 bytes; its
		 * DataLength must be the rest (else the relay's socket decides). */
		struct relay_key rkey = {};
		__u16 length = ((__u16)p[RELAY_HEAD] << 8) | p[RELAY_HEAD + 1];
		if (length == ulen - sizeof(struct udphdr) - RELAY_HEADER) {
			rkey.flow = *key;
			rkey.flow.channel = 0;
			__builtin_memcpy(rkey.head, p, RELAY_HEAD);
			r = bpf_map_lookup_elem(&relay_routes, &rkey);
			if (r && r->kind == KIND_RELAY)
				return r;
		}
	}
	key->channel = 0;
	r = bpf_map_lookup_elem(&routes, key);
	if (!r || r->kind == KIND_UNWRAP_CHANNEL || r->kind == KIND_RELAY)
		return NULL;
	return r;
}

/* ------------------------------------------------ tc ingress */

SEC("tc")
int crossroads_relay(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct route_key key = {};
	__u32 l4 = 0;
	__u16 ulen = 0;
	__u32 zero = 0;

	if (!lease_live())
		return PASS; /* its process is gone (or stalled): the sockets decide */
	if (skb->gso_size)
		return PASS; /* an aggregate: the stack splits it */
	if (parse_udp(data, end, &key, &l4, &ulen))
		return PASS;
	if (l4 > 64)
		return PASS;
	struct udphdr *udp = data + l4;
	if ((void *)(udp + 1) > end)
		return PASS;
	__u32 chanword = 0;
	struct route_val *r = find_route(&key, (void *)(udp + 1), end, ulen, &chanword);
	if (!r)
		return PASS;

	__u32 payload = ulen - sizeof(*udp);
	__u16 new_ulen = ulen;
	int delta = 0;
	if (r->kind == KIND_UNWRAP_CHANNEL) {
		delta = -CHANNEL_HEADER;
		payload -= CHANNEL_HEADER;
	} else if (r->kind == KIND_WRAP_CHANNEL) {
		if (ulen > 0xFFFF - CHANNEL_HEADER - 40)
			return PASS;
		delta = CHANNEL_HEADER;
		chanword = bpf_htonl(((__u32)r->channel << 16) | payload);
	}
	new_ulen = ulen + delta;
	__u16 new_sport = r->sport, new_dport = r->dport;
	__u16 check = udp->check;

	/* The data and the headers part by `delta` bytes. With a finished
	 * checksum the headers move (bpf_skb_adjust_room between IP and UDP,
	 * which parse_udp fixed at 20 or 40 bytes) and the UDP header is
	 * written whole below. A CHECKSUM_PARTIAL packet's csum_start would
	 * move with them, which no helper fixes: its data moves instead (copy
	 * it out, resize the tail, copy it back), after a header that stays. */
	int move_headers = delta && checksum_finished(&key, ulen, check);
	if (delta && !move_headers) {
		__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
		__u32 from = l4 + sizeof(*udp) + (delta < 0 ? CHANNEL_HEADER : 0);
		__u32 size = payload;
		if (!buf || size > MAX_MOVE)
			return PASS;
		if (size && bpf_skb_load_bytes(skb, from, buf, size & MAX_MOVE))
			return PASS;
		if (bpf_skb_change_tail(skb, l4 + new_ulen, 0))
			return PASS; /* nothing changed yet */
		__u32 to = l4 + sizeof(*udp) + (delta > 0 ? CHANNEL_HEADER : 0);
		if (size && bpf_skb_store_bytes(skb, to, buf, size & MAX_MOVE, 0))
			return TC_ACT_SHOT;
	}

	/* The UDP checksum's change as two deltas, one helper call each: the
	 * helpers know whether the checksum is complete or CHECKSUM_PARTIAL
	 * (only the pseudo-header's delta applies to a partial one). In the
	 * datagram: the ChannelData word removed or added (a 4-byte shift keeps
	 * the 16-bit alignment of what follows), the ports, the length field; in
	 * the pseudo-header: the addresses and the length. */
	int v4 = key.family == 4;
	__u32 len_old = bpf_htons(ulen), len_new = bpf_htons(new_ulen);
	__u32 in_from[3] = {delta < 0 ? chanword : 0, ((__u32)key.dport << 16) | key.sport,
			    len_old};
	__u32 in_to[3] = {delta > 0 ? chanword : 0, ((__u32)new_dport << 16) | new_sport,
			  len_new};
	__s64 in_diff = bpf_csum_diff(in_from, sizeof(in_from), in_to, sizeof(in_to), 0);
	__u32 ps_from[9] = {}, ps_to[9] = {};
	__s64 ps_diff;
	if (v4) {
		ps_from[0] = key.saddr[0];
		ps_from[1] = key.daddr[0];
		ps_from[2] = len_old;
		ps_to[0] = r->saddr[0];
		ps_to[1] = r->daddr[0];
		ps_to[2] = len_new;
		ps_diff = bpf_csum_diff(ps_from, 12, ps_to, 12, 0);
	} else {
		/* saddr and daddr are adjacent in the key, the value and the header. */
		__builtin_memcpy(ps_from, key.saddr, 32);
		__builtin_memcpy(ps_to, r->saddr, 32);
		ps_from[8] = len_old;
		ps_to[8] = len_new;
		ps_diff = bpf_csum_diff(ps_from, 36, ps_to, 36, 0);
	}
	if (in_diff < 0 || ps_diff < 0)
		return move_headers ? PASS : TC_ACT_SHOT; /* cannot be: the sizes are fixed */
	__u16 new_check = 0;
	if (move_headers) {
		if (check) { /* an IPv4 datagram without a checksum (0) keeps none */
			new_check = ~csum_fold((__u16)~check + (__u64)in_diff + (__u64)ps_diff);
			if (!new_check)
				new_check = 0xFFFF; /* a computed 0 is sent as all ones */
		}
		if (bpf_skb_adjust_room(skb, delta, BPF_ADJ_ROOM_NET, 0))
			return PASS; /* nothing changed yet (too long to grow, say) */
	} else {
		__u32 csum_off = l4 + offsetof(struct udphdr, check);
		csum_l4(skb, csum_off, 0, (__u32)in_diff, 0);
		csum_l4(skb, csum_off, 0, (__u32)ps_diff, BPF_F_PSEUDO_HDR);
	}

	/* The headers' fields, written in place (the checksum helpers above
	 * may have moved the data: fresh pointers). */
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	udp = data + l4;
	if ((void *)(udp + 1) > end)
		return TC_ACT_SHOT;
	udp->source = new_sport;
	udp->dest = new_dport;
	udp->len = (__u16)len_new;
	if (move_headers)
		udp->check = new_check;
	if (delta > 0) {
		__u8 *word = (void *)(udp + 1);
		if ((void *)(word + CHANNEL_HEADER) > end)
			return TC_ACT_SHOT;
		__builtin_memcpy(word, &chanword, CHANNEL_HEADER);
	}
	if (v4) {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		if ((void *)(ip + 1) > end)
			return TC_ACT_SHOT;
		/* The IPv4 header's checksum is always complete: recomputed here
		 * from the changed words (addresses, total length, TTL). */
		__u8 ttl_proto[2] = {NEW_HOP_LIMIT, IPPROTO_UDP};
		__u16 new_tot = bpf_htons(new_ulen + sizeof(*ip));
		__u32 from[4] = {ip->saddr, ip->daddr, ip->tot_len, *(__u16 *)&ip->ttl};
		__u32 to[4] = {r->saddr[0], r->daddr[0], new_tot, *(__u16 *)ttl_proto};
		__s64 diff = bpf_csum_diff(from, sizeof(from), to, sizeof(to), (__u16)~ip->check);
		if (diff < 0)
			return TC_ACT_SHOT;
		ip->saddr = r->saddr[0];
		ip->daddr = r->daddr[0];
		ip->tot_len = new_tot;
		ip->ttl = NEW_HOP_LIMIT;
		ip->check = ~csum_fold(diff);
	} else {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
		if ((void *)(ip6 + 1) > end)
			return TC_ACT_SHOT;
		__builtin_memcpy(&ip6->saddr, r->saddr, 32);
		ip6->payload_len = (__u16)len_new;
		ip6->hop_limit = NEW_HOP_LIMIT;
	}
	__sync_fetch_and_add(&r->packets, 1);
	__sync_fetch_and_add(&r->bytes, payload);
	if (delta) {
		__u32 way = move_headers ? TC_MOVED_HEADERS : TC_MOVED_DATA;
		__u64 *n = bpf_map_lookup_elem(&tc_moves, &way);
		if (n)
			*n += 1; /* per CPU: no atomics needed */
	}
	return bpf_redirect_neigh(r->ifindex, NULL, 0, 0);
}

/* ------------------------------------------------ XDP (driver mode) */

/* Egress devices an XDP frame may be sent to (XDP_TX or a redirect), the
 * value the families (bit 0 IPv4, bit 1 IPv6), written by user space
 * (kernelplane.py xdp_families): a NIC takes XDP frames only with its driver's XDP transmit path
 * set up (an XDP program on it), a veth only when its peer has NAPI (an
 * XDP program or GRO there), else the frame is dropped after the program
 * returned, where nothing can fall back. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, __u32);
} xdp_egress SEC(".maps");

/* Next hops user space resolved (kernelplane.py, from the routing and
 * neighbour tables, read again every second) for the destinations of routes
 * out of a device without forwarding, where bpf_fib_lookup answers only
 * FWD_DISABLED: the MACs to write and the device's MTU. Bounded like the
 * routes (one per destination and device at most), written only by user
 * space. */
struct next_hop_key {
	__u32 ifindex;
	__u32 daddr[4]; /* IPv4: [0] only */
	__u8 family;    /* 4 or 6 */
	__u8 pad[3];
};

struct next_hop {
	__u8 dmac[6];
	__u8 smac[6];
	__u32 mtu;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct next_hop_key);
	__type(value, struct next_hop);
} next_hops SEC(".maps");

/* What the XDP program did, per CPU: [XDP_FORWARDED] datagrams it forwarded
 * itself; routed datagrams it could not finish and passed to tc, by why:
 * an egress it may not send frames to, a partial checksum, no next hop it
 * can use (no neighbour entry yet, another device, over the MTU: the fib
 * lookup; with forwarding off, no next hop from user space yet), anything
 * else (a ChannelData datagram too long to wrap). */
#define XDP_FORWARDED 0
#define XDP_LEFT_EGRESS 1
#define XDP_LEFT_CHECKSUM 2
#define XDP_LEFT_NEXT_HOP 3
#define XDP_LEFT_OTHER 4
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 5);
	__type(key, __u32);
	__type(value, __u64);
} xdp_stats SEC(".maps");

static __always_inline int xdp_count(__u32 which, int action)
{
	__u64 *n = bpf_map_lookup_elem(&xdp_stats, &which);
	if (n)
		*n += 1; /* per CPU: no atomics needed */
	return action;
}

/* Headers moved by the ChannelData header's 4 bytes: Ethernet + IPv6 + UDP
 * at most (62 bytes), in whole words. */
#define HEAD_MAX 64

SEC("xdp")
int crossroads_relay_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct route_key key = {};
	__u32 l4 = 0;
	__u16 ulen = 0;

	if (!lease_live())
		return XDP_PASS;
	if (parse_udp(data, end, &key, &l4, &ulen))
		return XDP_PASS;
	if (l4 != sizeof(struct ethhdr) + sizeof(struct iphdr) &&
	    l4 != sizeof(struct ethhdr) + sizeof(struct ipv6hdr))
		return XDP_PASS;
	struct udphdr *udp = data + l4;
	if ((void *)(udp + 1) > end)
		return XDP_PASS;
	/* The whole datagram is in this buffer (no truncated or multi-buffer
	 * frame; Ethernet padding after it stays behind). */
	if (data + l4 + ulen > end)
		return XDP_PASS;
	__u32 chanword = 0;
	struct route_val *r = find_route(&key, (void *)(udp + 1), end, ulen, &chanword);
	if (!r)
		return XDP_PASS;

	/* Decide everything before changing a byte: what XDP cannot finish goes
	 * on to tc (this process's program is on the device too) untouched. */
	__u32 out = r->ifindex;
	int v4 = key.family == 4;
	__u32 *families = bpf_map_lookup_elem(&xdp_egress, &out);
	if (!families || !(*families & (v4 ? 1 : 2)))
		return xdp_count(XDP_LEFT_EGRESS, XDP_PASS);
	__u16 check = udp->check;
	/* A CHECKSUM_PARTIAL packet (a local or veth sender left the sum to the
	 * device) carries only its pseudo-header's sum; an XDP frame has no skb
	 * to say so and leaves as a finished packet, so an incremental update
	 * would send a wrong checksum. The field equal to the pseudo-header's
	 * folded sum means that (or, once in 65536 datagrams, a full checksum
	 * that happens to equal it): tc, whose helpers handle both, takes it. */
	if (!checksum_finished(&key, ulen, check))
		return xdp_count(XDP_LEFT_CHECKSUM, XDP_PASS);

	int delta = 0;
	__u32 payload = ulen - sizeof(struct udphdr);
	if (r->kind == KIND_UNWRAP_CHANNEL) {
		delta = -CHANNEL_HEADER;
		payload -= CHANNEL_HEADER;
	} else if (r->kind == KIND_WRAP_CHANNEL) {
		if (ulen > 0xFFFF - CHANNEL_HEADER - 40)
			return xdp_count(XDP_LEFT_OTHER, XDP_PASS);
		delta = CHANNEL_HEADER;
		chanword = bpf_htonl(((__u32)r->channel << 16) | payload);
	}
	__u16 new_ulen = ulen + delta;
	__u16 ip_len = new_ulen + (v4 ? sizeof(struct iphdr) : 0);

	/* The next hop: the route's device, and its neighbour's address known
	 * (else the stack resolves it: tc's bpf_redirect_neigh); tot_len makes
	 * the lookup check the route's MTU. */
	struct bpf_fib_lookup fib = {};
	fib.family = v4 ? 2 : 10; /* AF_INET, AF_INET6 */
	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = r->sport;
	fib.dport = r->dport;
	__u32 packet_len = v4 ? ip_len : ip_len + sizeof(struct ipv6hdr);
	fib.tot_len = packet_len;
	fib.ifindex = out;
	if (v4) {
		fib.ipv4_src = r->saddr[0];
		fib.ipv4_dst = r->daddr[0];
	} else {
		__builtin_memcpy(fib.ipv6_src, r->saddr, 16);
		__builtin_memcpy(fib.ipv6_dst, r->daddr, 16);
	}
	/* BPF_FIB_LOOKUP_OUTPUT: the relay sends this datagram from its own
	 * address (as its socket would), it does not forward the client's. */
	long rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	__u8 dmac[ETH_ALEN], smac[ETH_ALEN];
	if (rc == BPF_FIB_LKUP_RET_SUCCESS && fib.ifindex == out) {
		__builtin_memcpy(dmac, fib.dmac, ETH_ALEN);
		__builtin_memcpy(smac, fib.smac, ETH_ALEN);
	} else if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED) {
		/* Forwarding is off on the device (a relay host need not
		 * forward): the next hop user space resolved, if it has. */
		struct next_hop_key nkey = {};
		nkey.ifindex = out;
		nkey.family = key.family;
		__builtin_memcpy(nkey.daddr, r->daddr, 16);
		struct next_hop *hop = bpf_map_lookup_elem(&next_hops, &nkey);
		if (!hop || packet_len > hop->mtu)
			return xdp_count(XDP_LEFT_NEXT_HOP, XDP_PASS);
		__builtin_memcpy(dmac, hop->dmac, ETH_ALEN);
		__builtin_memcpy(smac, hop->smac, ETH_ALEN);
	} else {
		return xdp_count(XDP_LEFT_NEXT_HOP, XDP_PASS);
	}

	/* The UDP checksum's change, from the old words to the new: addresses
	 * (pseudo-header), ports, the length (header and pseudo-header) and the
	 * ChannelData word removed or added (a 4-byte shift keeps the 16-bit
	 * alignment of what follows). */
	__u32 from[11] = {}, to[11] = {};
	__u32 words = v4 ? 5 : 11;
	__u32 ports = ((__u32)key.dport << 16) | key.sport;
	__u32 new_ports = ((__u32)r->dport << 16) | r->sport;
	if (v4) {
		from[0] = key.saddr[0];
		from[1] = key.daddr[0];
		to[0] = r->saddr[0];
		to[1] = r->daddr[0];
		from[2] = ports;
		to[2] = new_ports;
		from[3] = ((__u32)bpf_htons(ulen) << 16) | bpf_htons(ulen);
		to[3] = ((__u32)bpf_htons(new_ulen) << 16) | bpf_htons(new_ulen);
		from[4] = delta < 0 ? chanword : 0;
		to[4] = delta > 0 ? chanword : 0;
	} else {
		__builtin_memcpy(from, key.saddr, 32);
		__builtin_memcpy(to, r->saddr, 32);
		from[8] = ports;
		to[8] = new_ports;
		from[9] = ((__u32)bpf_htons(ulen) << 16) | bpf_htons(ulen);
		to[9] = ((__u32)bpf_htons(new_ulen) << 16) | bpf_htons(new_ulen);
		from[10] = delta < 0 ? chanword : 0;
		to[10] = delta > 0 ? chanword : 0;
	}
	__u16 new_check = 0;
	if (check) { /* an IPv4 datagram without a checksum (0) keeps none */
		__s64 diff = bpf_csum_diff(from, words * 4, to, words * 4, (__u16)~check);
		if (diff < 0)
			return xdp_count(XDP_LEFT_OTHER, XDP_PASS);
		new_check = ~csum_fold(diff);
		if (!new_check)
			new_check = 0xFFFF; /* a computed 0 is sent as all ones */
	}

	/* Now change it. The Ethernet, IP and UDP headers move by the 4 bytes
	 * the ChannelData header takes or leaves (the data stays put). */
	__u8 head[HEAD_MAX];
	__u32 hlen = l4 + sizeof(struct udphdr);
	if (delta) {
		if (v4) {
			if (data + 42 > end)
				return XDP_PASS;
			__builtin_memcpy(head, data, 42);
		} else {
			if (data + 62 > end)
				return XDP_PASS;
			__builtin_memcpy(head, data, 62);
		}
		if (bpf_xdp_adjust_head(ctx, -delta))
			return XDP_PASS; /* nothing changed yet */
		data = (void *)(long)ctx->data;
		end = (void *)(long)ctx->data_end;
		if (v4) {
			if (data + 42 > end)
				return XDP_DROP; /* cannot be: it grew or had the 4 bytes */
			__builtin_memcpy(data, head, 42);
		} else {
			if (data + 62 > end)
				return XDP_DROP; /* cannot be: it grew or had the 4 bytes */
			__builtin_memcpy(data, head, 62);
		}
		if (delta > 0) {
			if (data + hlen + CHANNEL_HEADER > end || hlen > HEAD_MAX)
				return XDP_DROP;
			__builtin_memcpy(data + hlen, &chanword, CHANNEL_HEADER);
		}
	}
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return XDP_DROP;
	__builtin_memcpy(eth->h_dest, dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, smac, ETH_ALEN);
	if (v4) {
		struct iphdr *ip = (void *)(eth + 1);
		udp = (void *)(ip + 1);
		if ((void *)(udp + 1) > end)
			return XDP_DROP;
		ip->saddr = r->saddr[0];
		ip->daddr = r->daddr[0];
		ip->tot_len = bpf_htons(ip_len);
		ip->ttl = NEW_HOP_LIMIT;
		ip->check = 0;
		__u16 *w = (void *)ip;
		__u64 sum = 0;
#pragma unroll
		for (int i = 0; i < 10; i++)
			sum += w[i];
		ip->check = ~csum_fold(sum);
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		udp = (void *)(ip6 + 1);
		if ((void *)(udp + 1) > end)
			return XDP_DROP;
		__builtin_memcpy(&ip6->saddr, r->saddr, 16);
		__builtin_memcpy(&ip6->daddr, r->daddr, 16);
		ip6->payload_len = bpf_htons(new_ulen);
		ip6->hop_limit = NEW_HOP_LIMIT;
	}
	udp->source = r->sport;
	udp->dest = r->dport;
	udp->len = bpf_htons(new_ulen);
	udp->check = new_check;

	__sync_fetch_and_add(&r->packets, 1);
	__sync_fetch_and_add(&r->bytes, payload);
	xdp_count(XDP_FORWARDED, 0);
	if (out == ctx->ingress_ifindex)
		return XDP_TX;
	return bpf_redirect(out, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
