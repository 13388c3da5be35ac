//! Swagger UI in a real headless Chromium, driven over WebDriver (chromedriver): load the
//! page, authorize with a token, execute an admin call, read the answer, and see a plan's
//! limits in the documented bodies and schemas.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::*;

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session, both ended on drop.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        assert!(
            std::path::Path::new("/usr/bin/chromium").exists(),
            "Debian's chromium and chromium-driver are needed (.ci/run installs them)"
        );
        let port = free_port().unwrap();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (package chromium-driver)");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.path().display()),
                ]
            }
        }}});
        let r: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {r}"))
            .to_string();
        Browser {
            driver,
            base,
            session,
            http,
            _profile: profile,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method.clone(), url);
        if method != reqwest::Method::GET {
            req = req.json(&body);
        }
        req.send().await.unwrap().json::<Value>().await.unwrap()["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", json!({"url": url}))
            .await;
    }

    /// Waits for an element matching `css` and returns its id.
    async fn find(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = self
                .call(
                    reqwest::Method::POST,
                    "/element",
                    json!({"using": "css selector", "value": css}),
                )
                .await;
            if let Some(id) = v[ELEMENT].as_str() {
                return id.to_string();
            }
            assert!(Instant::now() < deadline, "no element {css:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            json!({}),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            json!({"text": text}),
        )
        .await;
    }

    /// Waits until the element's text satisfies `ok`, and returns it.
    async fn text_when(&self, css: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let id = self.find(css).await;
            let t = self
                .call(
                    reqwest::Method::GET,
                    &format!("/element/{id}/text"),
                    json!({}),
                )
                .await;
            let t = t.as_str().unwrap_or("").to_string();
            if ok(&t) {
                return t;
            }
            assert!(Instant::now() < deadline, "{css:?} says {t:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[tokio::test]
async fn swagger_ui_authorizes_with_a_token_and_executes_an_admin_call() {
    // Arrange: a gateway with a plan, and an admin token.
    let secret = "swagger-test-secret-0123456789abcdef";
    let toml = format!(
        "[admin]\njwt_hs256_secret = \"{secret}\"\n{}",
        catalog_toml(("gold", 10.0, 1.0), &[])
    );
    let s = settings(&toml);
    let token = tollgate::admin::auth::mint(&s.admin, "swagger", "admin:read", 600).unwrap();
    let gw = TestGateway::spawn(s).await;
    let browser = Browser::start().await;

    // Act: what a person does in Swagger UI.
    browser.goto(&format!("{}/swagger-ui/", gw.address)).await;
    browser.click(".auth-wrapper .authorize").await;
    browser.type_into(".auth-container input", &token).await;
    browser.click(".auth-btn-wrapper .authorize").await;
    browser.click(".auth-btn-wrapper .btn-done").await;
    browser
        .click("#operations-plans-listPlans .opblock-summary")
        .await;
    browser
        .click("#operations-plans-listPlans .try-out__btn")
        .await;
    browser.click("#operations-plans-listPlans .execute").await;

    // Assert: the call went out with the token and came back 200 with the plan.
    let status = browser
        .text_when(
            "#operations-plans-listPlans .live-responses-table tbody .response-col_status",
            |t| !t.trim().is_empty(),
        )
        .await;
    assert_eq!(status.trim(), "200");
    let body = browser
        .text_when(
            "#operations-plans-listPlans .live-responses-table tbody .response-col_description",
            |t| t.contains("gold"),
        )
        .await;
    assert!(body.contains("\"capacity\""), "{body}");
    // A plan is shown as its set of limits: the one bucket of the configured plan...
    assert!(
        body.contains("\"limits\"") && body.contains("\"default\""),
        "{body}"
    );

    // ...and the body of a plan write shows the worked example of several limits.
    browser
        .click("#operations-plans-putPlan .opblock-summary")
        .await;
    let example = browser
        .text_when(
            "#operations-plans-putPlan .opblock-section-request-body",
            |t| t.contains("\"limits\""),
        )
        .await;
    for part in [
        "\"monthly\"",
        "\"period\": \"month\"",
        "\"service\": \"search\"",
    ] {
        assert!(example.contains(part), "{part} not in {example}");
    }
    // Its schema: the plan body's fields, `limits` among them.
    browser
        .click(
            "#operations-plans-putPlan .opblock-section-request-body button.tablinks[data-name=\"model\"]",
        )
        .await;
    let schema = browser
        .text_when(
            "#operations-plans-putPlan .opblock-section-request-body",
            |t| t.contains("PlanInput"),
        )
        .await;
    // e.g. "limits … array<(object | object)>[1, 8] items": a bucket or a quota, 1 to 8.
    assert!(
        schema
            .lines()
            .any(|l| l.starts_with("limits") && l.contains("[1, 8] items")),
        "{schema}"
    );
    // The schemas list a limit as a bucket or a quota.
    let models = browser
        .text_when("section.models", |t| t.contains("PlanLimit"))
        .await;
    for model in ["BucketLimit", "QuotaLimit", "PlanView", "UsageView"] {
        assert!(models.contains(model), "{model} not in {models}");
    }
    browser.call(reqwest::Method::DELETE, "", json!({})).await;
}
