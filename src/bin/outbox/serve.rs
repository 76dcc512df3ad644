//! `outbox serve`: the health snapshot over HTTP, for scrapers and load balancers.

use chunked_outbox::Outbox;
use chunked_outbox::monitoring::Endpoint;
use clap::Args;

use crate::{CliResult, Thresholds};

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
    let endpoint = Endpoint::new(outbox.clone(), args.thresholds.to_library());
    for request in server.incoming_requests() {
        let answer = endpoint.respond(request.url());
        let header = tiny_http::Header::from_bytes("Content-Type", answer.content_type)
            .expect("a valid header");
        let response = tiny_http::Response::from_string(answer.body)
            .with_status_code(answer.status)
            .with_header(header);
        // A client that went away is its own business.
        let _ = request.respond(response);
    }
    Ok(0)
}
