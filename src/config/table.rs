//! `check-config`'s table of the effective limits.

use std::fmt::Write as _;

use super::Config;
use super::Limit;

impl Config {
    /// The effective limits as a table for `check-config`.
    pub fn limits_table(&self) -> String {
        let mut out = String::new();
        self.limits_rows(&mut out);
        self.callers_lines(&mut out);
        self.tools_rows(&mut out);
        out
    }

    /// Every limit's row: its scope, algorithm and parameters.
    fn limits_rows(&self, out: &mut String) {
        let _ = writeln!(out, "{:<34} {:<15} parameters", "scope", "algorithm");
        let limits = &self.limiting.limits;
        let in_flight = [
            Limit::enforced(limits.in_flight_caller.clone()),
            Limit::enforced(limits.in_flight_tenant.clone()),
            Limit::enforced(limits.in_flight_address.clone()),
        ];
        for (scope, list) in [
            ("http (per caller, POST /mcp)", limits.http.as_slice()),
            ("address_http (unverified, POST)", &limits.address_http),
            ("method tools/list (per caller)", &limits.tools_list),
            ("method tools/call (per caller)", &limits.tools_call),
            ("method other (per caller)", &limits.other_methods),
            ("caller (tool budget)", &limits.caller),
            ("tenant (shared tool budget)", &limits.tenant),
            ("address (unverified callers)", &limits.address),
            ("in flight (jobs per caller)", &in_flight[..1]),
            ("in flight (jobs per tenant)", &in_flight[1..2]),
            ("in flight (jobs per address)", &in_flight[2..]),
        ] {
            for limit in list {
                let shadow = if limit.enforced_mode() { "" } else { " (shadow)" };
                let scope = format!("{scope}{}", limit.suffix);
                let _ =
                    writeln!(out, "{scope:<34} {:<15} {}{shadow}", limit.limiter.algorithm(), limit.limiter.describe());
            }
        }
        if let Some(cap) = self.limiting.spend_caps.daily_units {
            let _ =
                writeln!(out, "{:<34} {:<15} {cap} cost units per UTC day", "spend cap (per tenant)", "fixed_window");
        }
    }

    /// Tiers, keys, the unverified callers' shares, sessions and connections.
    fn callers_lines(&self, out: &mut String) {
        let _ = writeln!(out);
        let tiers: Vec<String> = self.limiting.tiers.iter().map(|(t, f)| format!("{t} ×{f}")).collect();
        let _ = writeln!(out, "tiers (scale per-caller scopes): {}", tiers.join(", "));
        let _ = writeln!(
            out,
            "auth: {} configured key(s), key required: {}, anonymous tier: {}, caller ids: {}",
            self.limiting.auth.keys.len(),
            self.limiting.auth.required,
            self.limiting.auth.anonymous_tier,
            if self.limiting.auth.id_secret.is_some() { "keyed (auth.id_secret)" } else { "unkeyed SHA-256" }
        );
        let up = &self.upstream;
        let _ = writeln!(
            out,
            "unverified callers (no configured key), all addresses together: {} of the account's {} slots, {} of \
             its {} queue places; {} sessions per address, {} of {} all together",
            up.unverified_slots(),
            up.max_in_flight,
            up.unverified_places(),
            up.queue_max,
            self.server.max_sessions_per_address,
            self.server.unverified_sessions(),
            self.server.max_sessions
        );
        let _ = writeln!(
            out,
            "sessions: {} per configured key, {} per tenant; connections: {} per listener, {} per address (IPv6 by \
             /{}), {} streams each (HTTP/2); /metrics: {}",
            self.server.sessions_per_key(),
            self.server.sessions_per_tenant(),
            self.server.connections.max,
            self.server.connections.max_per_address,
            self.server.connections.ipv6_prefix,
            self.server.max_streams_per_connection,
            match (self.server.metrics_key_sha256.is_some(), self.limiting.auth.required) {
                (true, _) => "server.metrics_key required",
                (false, true) => "closed (auth.required, no server.metrics_key)",
                (false, false) => "open",
            }
        );
    }

    /// Every tool's cost and own budget, and how prices are settled.
    fn tools_rows(&self, out: &mut String) {
        let _ = writeln!(out);
        let _ = writeln!(out, "{:<34} {:<6} own budget (per tenant, address or caller; in calls)", "tool", "cost");
        for (tool, policy) in &self.limiting.tools {
            let budget: Vec<String> =
                policy.budget.iter().map(|b| format!("{} {}", b.limiter.algorithm(), b.limiter.describe())).collect();
            let budget = if budget.is_empty() { "-".to_owned() } else { budget.join(" + ") };
            let _ = writeln!(out, "{tool:<34} {:<6} {budget}", policy.cost);
            if let Some(formula) = &policy.formula {
                let _ = writeln!(out, "{:<34} (priced {formula}, at most {})", "", policy.cost);
            }
        }
        let settling = |how: super::Settle| -> Vec<&str> {
            (self.limiting.tools.iter())
                .filter(|(_, p)| p.settle == how && p.cost > 0)
                .map(|(t, _)| t.as_str())
                .collect()
        };
        let settles = match (self.limiting.unlisted_tools.is_some(), settling(super::Settle::Reserved)) {
            // A proxy: its server's answers price nothing unless the operator says so.
            (true, _) => match settling(super::Settle::Usage) {
                usage if usage.is_empty() => "a proxied tool is charged its cost, whatever its answer says".to_owned(),
                usage => format!(
                    "a proxied tool is charged its cost, except {}, settled from the usage they report in _meta",
                    usage.join(", ")
                ),
            },
            (false, reserved) if reserved.is_empty() => {
                "every price is settled from the usage the upstream reports".to_owned()
            }
            (false, reserved) => {
                format!("prices are settled from the usage the upstream reports, except {}", reserved.join(", "))
            }
        };
        let _ = writeln!(out, "{settles}; a call is first charged the cost above (reserved).");
    }
}
