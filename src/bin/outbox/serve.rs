//! `outbox serve`: the health snapshot over HTTP, for scrapers and load balancers.

use chunked_outbox::Outbox;
use clap::Args;

use crate::{CliResult, Thresholds, verdict};

#[derive(Args)]
pub struct ServeArgs {
    /// The address to listen on, such as 127.0.0.1:9464 (port 0: any free port; the
    /// first line printed names it).
    #[arg(long, value_name = "ADDR")]
    listen: String,
    #[command(flatten)]
    thresholds: Thresholds,
}

/// Answers requests until the process is stopped. Each answer reads a fresh snapshot,
/// so it shows what every process on the file has done.
pub fn serve(outbox: &Outbox, args: &ServeArgs) -> CliResult<u8> {
    let server = tiny_http::Server::http(&args.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = server
        .server_addr()
        .to_ip()
        .ok_or("the server has no IP address")?;
    println!("serving http://{addr}/metrics, /healthz and /health.json");
    std::io::Write::flush(&mut std::io::stdout())?;
    for request in server.incoming_requests() {
        let (status, kind, body) = answer(outbox, request.url(), &args.thresholds);
        let header = tiny_http::Header::from_bytes("Content-Type", kind).expect("a valid header");
        let response = tiny_http::Response::from_string(body)
            .with_status_code(status)
            .with_header(header);
        // A client that went away is its own business.
        let _ = request.respond(response);
    }
    Ok(0)
}

/// Status, content type and body for a request path.
fn answer(outbox: &Outbox, url: &str, thresholds: &Thresholds) -> (u16, &'static str, String) {
    let path = url.split('?').next().unwrap_or(url);
    let text = "text/plain; charset=utf-8";
    if !matches!(path, "/metrics" | "/healthz" | "/health.json") {
        return (
            404,
            text,
            "not found: try /metrics, /healthz or /health.json\n".into(),
        );
    }
    let health = match outbox.health() {
        Ok(h) => h,
        Err(e) => return (503, text, format!("fail: cannot read the outbox: {e}\n")),
    };
    match path {
        "/metrics" => (200, "text/plain; version=0.0.4", health.to_prometheus()),
        "/health.json" => match serde_json::to_string_pretty(&health) {
            Ok(json) => (200, "application/json", json),
            Err(e) => (500, text, format!("cannot write JSON: {e}\n")),
        },
        _ => {
            let (code, reasons) = verdict(&health, thresholds);
            let word = ["ok", "warn", "fail"][usize::from(code)];
            let mut body = word.to_owned();
            if !reasons.is_empty() {
                body.push_str(": ");
                body.push_str(&reasons.join("; "));
            }
            body.push('\n');
            (if code == 2 { 503 } else { 200 }, text, body)
        }
    }
}
